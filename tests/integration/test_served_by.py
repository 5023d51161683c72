"""Which backend served each task's calls: the tree JSON, ``show``, the CLI tree, the page.

A cost is an estimate when a charged call was served by a backend that did not run the
routed model (offline, a replay): ``cost_estimated`` on the task, ``estimated_usd`` in the
totals, ``(est.)`` on the CLI and the page. The calls are written straight into the
database on a finished tree (tests/timed_tree.py: one ``ollama`` call per task).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from runtime.cli.app import app
from runtime.cli.render import served_text
from runtime.store.store import Store
from runtime.views import tree_json, tree_text
from runtime.wiring import Runtime
from tests.timed_tree import TimedTree, build_timed_tree

runner = CliRunner()
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def serve_calls(store: Store) -> TimedTree:
    """A finished tree whose calls were served by offline, the embedded model and a replay.

    lead-0: two offline calls charged at qwen3:14b's price (an estimate); writer-0-0: one
    embedded call of the GGUF file at its price 0; writer-0-1: an offline call and one
    answered from the record (zero, replayed); the other tasks keep their ollama call.
    """
    tree = build_timed_tree(store, leads=2, writers=2)
    ids = tree.ids
    with store.database.transaction() as conn:
        conn.execute(sa.text(
            "UPDATE model_calls SET backend = 'offline', route = 'cloud', model = 'qwen3:14b' "
            "WHERE task_id = CAST(:id AS uuid)"), {"id": str(ids["lead-0"])})
        conn.execute(sa.text(
            "INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, "
            "model, prompt, prompt_tokens, completion_tokens, cost_usd) "
            "SELECT id, root_id, 1, 1, 'offline', 'cloud', 'qwen3:14b', 'p', 10, 10, 0.002 "
            "FROM tasks WHERE id = CAST(:id AS uuid)"), {"id": str(ids["lead-0"])})
        conn.execute(sa.text(
            "UPDATE model_calls SET backend = 'embedded', model = :gguf, cost_usd = 0 "
            "WHERE task_id = CAST(:id AS uuid)"), {"id": str(ids["writer-0-0"]), "gguf": GGUF})
        conn.execute(sa.text("UPDATE tasks SET model = :gguf WHERE id = CAST(:id AS uuid)"),
                     {"id": str(ids["writer-0-0"]), "gguf": GGUF})
        conn.execute(sa.text(
            "UPDATE model_calls SET backend = 'offline' WHERE task_id = CAST(:id AS uuid)"),
            {"id": str(ids["writer-0-1"])})
        conn.execute(sa.text(
            "INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, "
            "model, prompt, cost_usd, replayed) SELECT id, root_id, 2, 0, 'offline', 'local', "
            "'qwen3:0.6b', 'p', 0, true FROM tasks WHERE id = CAST(:id AS uuid)"),
            {"id": str(ids["writer-0-1"])})
    return tree


def nodes(tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {tree["id"]: tree}
    for child in tree["children"]:
        out.update(nodes(child))
    return out


def test_the_tree_json_says_who_served_each_task_and_what_is_estimated(store: Store) -> None:
    tree = serve_calls(store)
    ids = {name: str(i) for name, i in tree.ids.items()}
    for fields in ("full", "summary"):
        read = json.loads(tree_text(store, tree.root, fields=fields)[0])
        by_id = nodes(read)
        assert by_id[ids["lead-0"]]["served_by"] == {"offline": 2}
        assert by_id[ids["lead-0"]]["cost_estimated"] is True
        assert by_id[ids["writer-0-0"]]["served_by"] == {"embedded": 1}
        assert by_id[ids["writer-0-0"]]["cost_estimated"] is False
        assert by_id[ids["writer-0-1"]]["served_by"] == {"offline": 1, "replay": 1}
        assert by_id[ids["lead-1"]]["served_by"] == {"ollama": 1}
        assert by_id[ids["lead-1"]]["cost_estimated"] is False
        totals = read["totals"]
        assert totals["served_by"] == {"embedded": 1, "offline": 3, "ollama": 4, "replay": 1}
    # The estimate: the own spend of the tasks served offline (lead-0, writer-0-1).
    own = {t["id"]: t["own_usd"] for t in store.reads.tree_rows(tree.root)}
    estimated = own[tree.ids["lead-0"]] + own[tree.ids["writer-0-1"]]
    assert totals["estimated_usd"] == f"{estimated:.8f}"
    # The Python path (GET /tasks, the follower's rows) gives the same.
    assert json.loads(tree_text(store, tree.root)[0]) == json.loads(
        json.dumps(tree_json(store.reads.tree_rows(tree.root)), default=str))


def test_served_text_names_the_model_only_when_it_ran() -> None:
    assert served_text({"served_by": {"offline": 2}, "cost_estimated": True,
                        "route": "cloud", "model": "qwen3:14b"}) == "offline (est.)"
    assert served_text({"served_by": {"embedded": 1}, "cost_estimated": False,
                        "route": "cloud", "model": GGUF}) == f"embedded cloud:{GGUF}"
    assert served_text({"served_by": {"replay": 1, "offline": 1},
                        "cost_estimated": True}) == "offline 1, replay 1 (est.)"
    assert served_text({"served_by": None}) == ""


@pytest.fixture
def cli_runtime(orgchart_env: dict[str, str], make_runtime: Callable[..., Runtime]) -> Runtime:
    return make_runtime()


def test_the_cli_tree_and_show_say_who_served(cli_runtime: Runtime) -> None:
    tree = serve_calls(cli_runtime.store)
    result = runner.invoke(app, ["tree", str(tree.root)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    lead = next(line for line in lines if str(tree.ids["lead-0"])[:8] in line)
    assert "offline (est.) $" in lead and "qwen3:14b" not in lead
    writer = next(line for line in lines if str(tree.ids["writer-0-0"])[:8] in line)
    assert f"embedded local:{GGUF}" in writer and "(est.)" not in writer
    totals = next(line for line in lines if "totals:" in line)
    assert "served by embedded 1 call, offline 3 calls, ollama 4 calls, replay 1 call" in totals
    assert "est.: the price of a model that did not run" in totals
    shown = runner.invoke(app, ["show", str(tree.ids["lead-0"]), "--json"])
    assert shown.exit_code == 0, shown.output
    detail = json.loads(shown.stdout)
    assert detail["served_by"] == {"offline": 2} and detail["cost_estimated"] is True
    text = runner.invoke(app, ["show", str(tree.ids["writer-0-1"])], env={"COLUMNS": "250"})
    assert "offline 1, replay 1 (est.)" in text.stdout


def test_get_task_says_who_served(client: Any, store: Store) -> None:
    tree = serve_calls(store)
    task = client.get(f"/tasks/{tree.ids['writer-0-0']}").json()
    assert task["served_by"] == {"embedded": 1} and task["cost_estimated"] is False
    assert task["model"] == GGUF
    assert client.get(f"/tasks/{uuid.uuid4()}").status_code == 404


def test_metrics_spend_by_backend_says_what_is_estimated(cli_runtime: Runtime) -> None:
    serve_calls(cli_runtime.store)
    result = runner.invoke(app, ["metrics", "--json"])
    assert result.exit_code == 0, result.output
    by_backend = json.loads(result.stdout)["cost_by_backend"]
    offline, embedded = by_backend["offline"], by_backend["embedded"]
    assert offline["calls"] == 3 and offline["estimated_usd"] == offline["cost_usd"] != "0.00000000"
    assert embedded == {"calls": 1, "tokens": embedded["tokens"], "cost_usd": "0.00000000",
                        "estimated_usd": "0.00000000"}
    assert by_backend["replay"]["cost_usd"] == "0.00000000"
    assert by_backend["ollama"]["estimated_usd"] == "0.00000000"
    text = runner.invoke(app, ["metrics"], env={"COLUMNS": "200"}).stdout
    assert "spend by backend" in text and "offline" in text
