"""Ids as ``orgchart tree`` prints them (8 characters) work in every command (issue 45, item 4).

A unique prefix of 4 or more hex characters names a task in every CLI command that takes a
task or root id; an ambiguous one exits 2 listing the candidates; one that starts no id
exits 2 saying so. The prefix is read as a range of UUIDs, which the primary key answers.
The HTTP API keeps taking whole ids only.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from runtime.cli.app import app
from runtime.cli.common import TaskRef
from runtime.errors import BadInput
from runtime.store.queries import QUERIES
from runtime.store.rows import NewTask
from runtime.wiring import Runtime

A = uuid.UUID("aaaa1111-0000-4000-8000-000000000001")
B = uuid.UUID("aaaa2222-0000-4000-8000-000000000002")

runner = CliRunner()


@pytest.fixture
def runtime(orgchart_env: dict[str, str], make_runtime: Callable[..., Runtime]) -> Runtime:
    """Two pending roots whose ids share the prefix ``aaaa``."""
    rt = make_runtime()
    for task_id in (A, B):
        rt.store.tasks.submit(NewTask("echo", "task", {"goal": "short ids"}), task_id=task_id)
    return rt


def cli(*args: str) -> Any:
    return runner.invoke(app, list(args))


def test_a_prefix_is_read_as_the_range_of_ids_it_starts() -> None:
    ref = TaskRef.parse("925C0B5F", "root id")
    assert ref.exact is None
    assert (str(ref.lo), str(ref.hi)) == ("925c0b5f-0000-0000-0000-000000000000",
                                          "925c0b5f-ffff-ffff-ffff-ffffffffffff")
    assert TaskRef.parse("925c0b5f-3f4").lo == uuid.UUID("925c0b5f-3f40-0000-0000-000000000000")
    assert TaskRef.parse(f" {A} ").exact == A
    for bad in ("abc", "zzzz", "", "925c0b5f!"):
        with pytest.raises(BadInput, match="is not a UUID, nor a prefix"):
            TaskRef.parse(bad)


#: Each command given A's 8-character prefix, and what its output shows when it resolved
#: the prefix to A (its answer may be a refusal: A is a pending task to ``echo``).
COMMANDS: list[tuple[str, ...]] = [
    ("show", "aaaa1111", "--json"),
    ("tree", "aaaa1111", "--json"),
    ("cancel", "aaaa1111"),
    ("pause", "aaaa1111"),
    ("resume", "aaaa1111"),
    ("answer", "aaaa1111", "--json", "1"),
    ("approve", "aaaa1111"),
    ("reject", "aaaa1111", "--note", "no"),
    ("resolve", "aaaa1111", "--done"),
    ("fork", "aaaa1111"),
    ("diff", "aaaa1111", "aaaa2222"),
    ("llm", "record", "aaaa1111", "--out", "{tmp}/tree.jsonl"),
    ("dataset", "from-roots", "cases", "aaaa1111"),
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_command_taking_an_id_takes_the_prefix_tree_prints(
        runtime: Runtime, tmp_path: Path, args: tuple[str, ...]) -> None:
    result = cli(*(a.replace("{tmp}", str(tmp_path)) for a in args))
    said = result.stdout + result.stderr
    assert "is not a UUID" not in said and "no task id starts" not in said, said
    assert str(A) in said, said


def test_audit_root_takes_a_prefix(runtime: Runtime) -> None:
    result = cli("audit", "--root", "aaaa1111", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["checked"]["trees"] == 1


def test_an_ambiguous_prefix_exits_2_listing_the_candidates(runtime: Runtime) -> None:
    result = cli("show", "aaaa")
    assert result.exit_code == 2
    assert "'aaaa' is ambiguous" in result.stderr
    assert str(A) in result.stderr and str(B) in result.stderr
    assert cli("show", "aaaa2", "--json").exit_code == 0


def test_a_prefix_of_no_task_and_a_short_one_exit_2(runtime: Runtime) -> None:
    missing = cli("tree", "ffff0000")
    assert missing.exit_code == 2 and "no task id starts with 'ffff0000'" in missing.stderr
    short = cli("tree", "aaa")
    assert short.exit_code == 2 and "4 or more hex characters" in short.stderr


def test_the_prefix_lookup_is_a_range_on_the_primary_key(runtime: Runtime) -> None:
    ref = TaskRef.parse("aaaa1111")
    with runtime.store.engine.begin() as conn:
        # The table is tiny here: forbid the sequential scan to see whether an index can
        # answer at all (for id::text LIKE it could not, and the plan would still scan).
        conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
        plan = conn.execute(sa.text("EXPLAIN " + QUERIES["task_find_by_id_prefix"]),
                            {"lo": ref.lo, "hi": ref.hi, "limit": 11}).scalars().all()
    assert any("Index" in line and "pk_tasks" in line for line in plan), plan


def test_the_http_api_keeps_whole_ids(runtime: Runtime, client: Any) -> None:
    assert client.get(f"/tasks/{A}").status_code == 200
    assert client.get("/tasks/aaaa1111").status_code == 422
