"""A claimed ``TaskRow`` carries the columns the engine reads, and the engine reads no other.

A claim returns ``fragment_claimed_columns``, not ``t.*`` (52 columns cost twice the
psycopg time per claimed row). The fields it leaves out keep their defaults on a claimed
row, so engine code that read one would silently see ``None``: this test fails first.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from runtime.store.queries import QUERIES
from runtime.store.rows import TaskRow

ROOT = Path(__file__).resolve().parents[2]
#: The code that receives claimed rows: the worker, the executor, the model layer, the
#: agents (their context), the policies, the budget rules.
ENGINE_CODE = ["runtime/engine", "runtime/llm", "agents", "policies", "runtime/budget.py"]
#: The fields of a task row.
TASK_FIELDS = frozenset(f.name for f in dataclasses.fields(TaskRow))
#: Computed by the claim itself, not columns of tasks.
COMPUTED = {"claimed_from", "recorded_calls", "counterpart_calls"}


def claimed_columns() -> set[str]:
    return set(re.findall(r"\bt\.(\w+)", QUERIES["fragment_claimed_columns"]))


def engine_sources() -> dict[str, str]:
    files: list[Path] = []
    for part in ENGINE_CODE:
        path = ROOT / part
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return {str(f.relative_to(ROOT)): f.read_text(encoding="utf-8") for f in files}


def test_every_claim_returns_the_claimed_columns() -> None:
    for name in ("task_claim_available", "task_claim_capped", "task_claim_judging"):
        sql = QUERIES[name]
        assert "RETURNING t.*" not in sql, name
        assert all(f"t.{c}" in sql for c in claimed_columns()), name


def test_the_claimed_columns_are_task_row_fields() -> None:
    assert claimed_columns() <= TASK_FIELDS


def test_the_engine_reads_no_column_a_claim_leaves_out() -> None:
    left_out = TASK_FIELDS - claimed_columns() - COMPUTED
    assert "created_at" in left_out and "lease_expires_at" in left_out  # the test can fail
    reads = []
    for path, text in engine_sources().items():
        for name in sorted(left_out):
            if re.search(rf"\.{name}\b|[\"']{name}[\"']", text):
                reads.append(f"{path}: {name}")
    assert not reads, ("engine code reads columns the claim does not return; add them to "
                       f"fragment_claimed_columns in queries.sql: {reads}")
