"""``orgchart tree|show|escalations|resolve|metrics|prune|serve`` on the real test database."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from typer.testing import CliRunner

from runtime.cli.app import app
from runtime.errors import BadInput
from runtime.http.auth import is_loopback
from runtime.store.rows import NewTask
from runtime.views import parse_task_id, policy_rule, tree_json
from runtime.wiring import Runtime
from tests.support import drain

runner = CliRunner()


@pytest.fixture
def runtime(orgchart_env: dict[str, str], make_runtime: Callable[..., Runtime]) -> Runtime:
    return make_runtime(ORGCHART_RETRY__MAX_RETRY="0")


def submit(runtime: Runtime, agent: str = "echo", **payload: Any) -> uuid.UUID:
    task, _ = runtime.store.tasks.submit(NewTask(agent, "task", {"goal": "inspect me", **payload}))
    return task["id"]


def cli(*args: str) -> Any:
    return runner.invoke(app, list(args))


def cli_json(*args: str) -> Any:
    result = cli(*args, "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def as_json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# ---------------------------------------------------------------------- helpers
def test_parse_task_id_names_the_bad_value() -> None:
    assert parse_task_id(" 00000000-0000-0000-0000-000000000001 ") == uuid.UUID(int=1)
    with pytest.raises(BadInput, match="root id 'xyz' is not a UUID"):
        parse_task_id("xyz", "root id")


def test_policy_rule_reads_the_prefix_only() -> None:
    assert policy_rule("policy max_depth: too deep") == "max_depth"
    assert policy_rule("2 children failed") is None
    assert policy_rule(None) is None


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("localhost", True), ("::1", True), ("127.1.2.3", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("example.com", False)])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# ---------------------------------------------------------------------- tree
def test_tree_json_is_tree_json_of_the_stored_rows(runtime: Runtime) -> None:
    root = submit(runtime, "fanout", n=3)
    drain(runtime)
    tree = cli_json("tree", str(root))
    assert tree == as_json(tree_json(runtime.store.reads.tree_rows(root)))
    assert tree["status"] == "done" and tree["totals"]["tasks"] == 4


def test_tree_draws_statuses_agents_and_totals(runtime: Runtime) -> None:
    root = submit(runtime, "fanout", n=2)
    drain(runtime)
    result = cli("tree", str(root))
    assert result.exit_code == 0, result.stderr
    drawing, _, summary = result.stdout.partition("critical path ")
    assert "fanout" in drawing and drawing.count("echo") == 2
    assert "done" in drawing and "totals: 3 tasks" in drawing
    assert summary.rstrip().endswith("queued (fanout > echo)")


def test_tree_watch_on_a_finished_tree_returns_at_once(runtime: Runtime) -> None:
    root = submit(runtime)
    drain(runtime)
    assert cli_json("tree", str(root), "--watch")["status"] == "done"
    assert cli("tree", str(root), "--watch").exit_code == 0


@pytest.mark.parametrize("command", ["tree", "show", "resolve"])
def test_a_malformed_id_exits_2_naming_it(runtime: Runtime, command: str) -> None:
    result = cli(command, "not-an-id", *(["--done"] if command == "resolve" else []))
    assert result.exit_code == 2
    assert "'not-an-id' is not a UUID" in result.stderr


@pytest.mark.parametrize("command", ["tree", "show", "resolve"])
def test_a_missing_task_exits_2_with_no_task(runtime: Runtime, command: str) -> None:
    missing = uuid.uuid4()
    result = cli(command, str(missing), *(["--done"] if command == "resolve" else []))
    assert result.exit_code == 2
    assert f"no task {missing}" in result.stderr


def test_tree_of_a_child_names_its_root(runtime: Runtime) -> None:
    root = submit(runtime, "fanout", n=1)
    drain(runtime)
    child = runtime.store.reads.children(root)[0]["id"]
    result = cli("tree", str(child))
    assert result.exit_code == 2
    assert f"not a root; its tree is {root}" in result.stderr


# ---------------------------------------------------------------------- show
def test_show_has_the_task_its_history_children_and_model_calls(runtime: Runtime) -> None:
    root = submit(runtime, "fanout", n=2)
    drain(runtime)
    shown = cli_json("show", str(root))
    assert shown["id"] == str(root) and shown["status"] == "done"
    assert [e["to_status"] for e in shown["events"]] == [
        "pending", "running", "waiting", "ready_to_aggregate", "running", "done"]
    assert len(shown["children"]) == 2 and shown["model_calls"] == []
    text = cli("show", str(root))
    assert text.exit_code == 0
    assert "history" in text.stdout and "children (2)" in text.stdout
    assert "ready_to_aggregate" in text.stdout


# ---------------------------------------------------------------------- escalations
def escalate(runtime: Runtime) -> uuid.UUID:
    root = submit(runtime, "fanout", n=2, child="flaky")
    drain(runtime)
    assert runtime.store.reads.get(root)["status"] == "escalated"
    return root


def test_escalations_lists_rule_error_root_and_goal(runtime: Runtime) -> None:
    assert cli_json("escalations") == []
    assert "no escalations" in cli("escalations").stdout
    root = escalate(runtime)
    mail = runtime.store.tasks.submit(NewTask("echo", "task", {"goal": "mail bob@example.com"}))[0]
    drain(runtime)
    items = cli_json("escalations")
    assert [i["id"] for i in items] == [str(root), str(mail["id"])]
    assert items[0]["rule"] is None and items[0]["error"] == "2 children failed"
    assert items[0]["root_goal"] == "inspect me" and items[0]["root_id"] == str(root)
    assert items[1]["rule"] == "forbidden_output"
    text = cli("escalations").stdout
    assert "forbidden_output" in text and "2 children failed" in text


# ---------------------------------------------------------------------- resolve
def test_resolve_needs_exactly_one_action(runtime: Runtime) -> None:
    root = escalate(runtime)
    none = cli("resolve", str(root))
    assert none.exit_code == 2 and "exactly one of" in none.stderr
    two = cli("resolve", str(root), "--done", "--fail")
    assert two.exit_code == 2 and "(got --done, --fail)" in two.stderr
    assert runtime.store.reads.get(root)["status"] == "escalated"


def test_resolve_done_then_again_is_refused(runtime: Runtime) -> None:
    root = escalate(runtime)
    done = cli("resolve", str(root), "--done", "--note", "looked fine")
    assert done.exit_code == 0, done.stderr
    assert "escalated -> done" in done.stdout
    assert runtime.store.reads.get(root)["status"] == "done"
    assert "looked fine" in runtime.store.reads.events(root)[-1]["detail"]
    again = cli("resolve", str(root), "--fail")
    assert again.exit_code == 2 and "not escalated" in again.stderr


def test_resolve_retry_and_reassign(runtime: Runtime) -> None:
    root = escalate(runtime)
    unknown = cli("resolve", str(root), "--reassign", "fanot", "--agents-module",
                  "tests.support_agents")
    assert unknown.exit_code == 2 and "did you mean 'fanout'" in unknown.stderr
    moved = cli_json("resolve", str(root), "--reassign", "echo", "--agents-module",
                     "tests.support_agents")
    assert moved["status"] == "pending" and moved["agent"] == "echo"


# ---------------------------------------------------------------------- metrics, prune, serve
def test_metrics_json_has_the_seed_keys(runtime: Runtime) -> None:
    submit(runtime)
    drain(runtime)
    metrics = cli_json("metrics")
    assert {"by_status", "avg_retry", "reclaimed_count", "avg_duration_seconds",
            "cost_by_route"} <= set(metrics)
    assert metrics["by_status"] == {"done": 1}
    assert "tasks by status" in cli("metrics").stdout


def test_prune_removes_finished_trees_only(runtime: Runtime) -> None:
    finished = submit(runtime, "fanout", n=2)
    drain(runtime)
    waiting = submit(runtime)
    bad = cli("prune", "--older-than", "a week")
    assert bad.exit_code == 2 and "cannot read duration 'a week'" in bad.stderr
    assert cli_json("prune", "--older-than", "1d") == {"trees": 0, "tasks": 0,
                                                       "older_than_seconds": 86400.0}
    result = cli("prune", "--older-than", "0s")
    assert result.exit_code == 0, result.stderr
    assert "removed 1 trees (3 tasks)" in result.stdout
    assert runtime.store.reads.tree_rows(finished) == []
    assert runtime.store.reads.get(waiting)["status"] == "pending"


def test_serve_refuses_a_public_host_without_a_token(orgchart_env: dict[str, str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORGCHART_API_TOKEN", raising=False)
    result = cli("serve", "--host", "0.0.0.0")
    assert result.exit_code == 2
    assert "refusing to listen on 0.0.0.0 without ORGCHART_API_TOKEN" in result.stderr


def test_submit_to_an_approval_agent_says_the_root_is_held(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORGCHART_POLICIES__REQUIRE_APPROVAL", "echo")
    result = cli("submit", "a goal that needs a yes", "--agent", "echo",
                 "--agents-module", "tests.support_agents")
    assert result.exit_code == 0, result.output
    task_id = result.stdout.strip()
    assert f"held for approval ([policies] require_approval lists echo): orgchart approve " \
           f"{task_id}" in result.stderr
    assert runtime.store.reads.get(uuid.UUID(task_id))["status"] == "awaiting_approval"


def test_submit_takes_a_tenant_and_tree_shows_it(runtime: Runtime) -> None:
    task = cli_json("submit", "tenant goal", "--agent", "echo", "--tenant", "acme",
                    "--agents-module", "tests.support_agents")
    assert task["tenant"] == "acme"
    shown = cli("tree", task["id"])
    assert shown.exit_code == 0 and "tenant acme" in shown.stdout, shown.stdout
    bad = cli("submit", "x", "--agent", "echo", "--tenant", "no spaces",
              "--agents-module", "tests.support_agents")
    assert bad.exit_code == 2 and "tenant" in bad.output
