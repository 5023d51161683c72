"""A tool that requires approval holds its task until a person approves the call.

A real worker runs the ``clerk`` agent (``tests/approval_agents.py``) on the
offline backend, which calls the clerk's one tool in its first round. The call needs
approval: the task goes to ``awaiting_approval`` naming the call, the tool has not run.
``approve`` makes it pending; the next delivery replays the recorded model call and
runs the tool once. ``reject`` fails the task and the tool never runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from runtime.store.rows import NewTask
from runtime.wiring import Runtime
from tests.approval_agents import PAID
from tests.factories import expire_leases


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime]) -> Runtime:
    PAID.clear()
    return make_runtime(["tests.approval_agents"])


def drive(runtime: Runtime, task_id: Any, until: str) -> dict[str, Any]:
    worker = runtime.worker(["clerk", "judge"], maintenance=False, listen=False)
    for _ in range(30):
        worker.run_once()
        row = runtime.store.reads.get(task_id)
        if row["status"] == until:
            return row
    raise AssertionError(f"task is {runtime.store.reads.get(task_id)['status']}, not {until}")


def test_an_approved_tool_call_runs_once_after_the_approval(runtime: Runtime) -> None:
    store = runtime.store
    task, _ = store.tasks.submit(NewTask(to_agent="clerk", type="task", payload={"goal": "ACME"}))
    held = drive(runtime, task["id"], "awaiting_approval")
    assert PAID == [] and held["lease_token"] is None
    hold = [e for e in store.reads.events(task["id"]) if e["to_status"] == "awaiting_approval"]
    assert hold[0]["detail"].startswith("tool call 0#0.0 (send_payment) waits for a "
                                        "person's approval")
    # The ask names exactly the call: its id (the step's position), tool and arguments.
    (ask,) = store.steps.tool_approvals(task["id"])
    assert (ask["phase"], ask["call_id"], ask["tool"], ask["status"]) == (
        "run", "0#0.0", "send_payment", "asked")
    assert store.steering.approve(task["id"], note="go ahead").changed
    (ask,) = store.steps.tool_approvals(task["id"])
    assert (ask["status"], ask["decided_by"]) == ("approved", "person")
    done = drive(runtime, task["id"], "done")
    assert len(PAID) == 1 and done["result"]["paid"] == [{"paid": True}]
    calls = store.reads.model_calls(task["id"])
    # The first round was paid once and replayed after the approval (a replay's row is
    # written with the task's outcome, so it is the last).
    assert sorted((c["position"], c["replayed"]) for c in calls) == [
        ("0#0", False), ("0#0", True), ("0#1", False)]
    (step,) = store.steps.for_task(task["id"])
    assert (step["name"], step["status"], step["starts"]) == ("send_payment", "finished", 1)
    assert step["args_hash"] == ask["args_hash"]


def test_a_redelivery_after_the_approval_does_not_ask_again(runtime: Runtime) -> None:
    store = runtime.store
    task, _ = store.tasks.submit(NewTask(to_agent="clerk", type="task", payload={"goal": "ACME"}))
    drive(runtime, task["id"], "awaiting_approval")
    assert store.steering.approve(task["id"]).changed
    # A worker claims the approved task and dies before it gets anywhere.
    (claimed,) = store.claims.claim(["clerk"], 1, "doomed", 30)
    assert claimed["id"] == task["id"]
    expire_leases(store)
    assert store.hygiene.reap(max_delivery=10).released == 1
    done = drive(runtime, task["id"], "done")
    assert len(PAID) == 1 and done["result"]["paid"] == [{"paid": True}]
    holds = [e for e in store.reads.events(task["id"]) if e["to_status"] == "awaiting_approval"]
    assert len(holds) == 1
    assert [a["status"] for a in store.steps.tool_approvals(task["id"])] == ["approved"]


def test_a_rejected_tool_call_never_runs(runtime: Runtime) -> None:
    store = runtime.store
    task, _ = store.tasks.submit(NewTask(to_agent="clerk", type="task", payload={"goal": "ACME"}))
    drive(runtime, task["id"], "awaiting_approval")
    assert store.steering.reject(task["id"], "not this supplier").changed
    failed = store.reads.get(task["id"])
    assert (failed["status"], failed["error"]) == ("failed",
                                                   "rejected by person: not this supplier")
    assert PAID == [] and store.steps.for_task(task["id"]) == []
    (ask,) = store.steps.tool_approvals(task["id"])
    assert (ask["call_id"], ask["status"], ask["note"]) == (
        "0#0.0", "denied", "rejected by person: not this supplier")


def test_a_rerun_replays_an_approved_call_without_asking_again(runtime: Runtime) -> None:
    from runtime.forks import fork

    store = runtime.store
    task, _ = store.tasks.submit(NewTask(to_agent="clerk", type="task", payload={"goal": "ACME"}))
    drive(runtime, task["id"], "awaiting_approval")
    assert store.steering.approve(task["id"]).changed
    drive(runtime, task["id"], "done")
    assert len(PAID) == 1
    # A re-run asks for no approval: the call is served from the original's record and
    # never runs, so there is nothing for a person to approve.
    branch = fork(store, runtime.registry, runtime.settings, task["id"], note="re-run")
    done = drive(runtime, branch["id"], "done")
    assert len(PAID) == 1 and done["result"] == store.reads.get(task["id"])["result"]
    assert store.steps.tool_approvals(branch["id"]) == []
    (step,) = store.steps.for_task(branch["id"])
    assert (step["status"], step["starts"], step["replays"]) == ("finished", 0, 1)
    # Other arguments are another call: it asks, and does not run before the approval.
    other = fork(store, runtime.registry, runtime.settings, task["id"],
                 payload={"goal": "Initech"}, note="another customer")
    drive(runtime, other["id"], "awaiting_approval")
    (ask,) = store.steps.tool_approvals(other["id"])
    assert ask["status"] == "asked" and len(PAID) == 1


def test_show_lists_the_ask_and_the_decision(runtime: Runtime,
                                             orgchart_env: dict[str, str]) -> None:
    from typer.testing import CliRunner

    from runtime.cli.app import app

    store = runtime.store
    task, _ = store.tasks.submit(NewTask(to_agent="clerk", type="task", payload={"goal": "ACME"}))
    drive(runtime, task["id"], "awaiting_approval")
    assert store.steering.approve(task["id"], note="go ahead").changed
    shown = CliRunner().invoke(app, ["show", str(task["id"]), "--json"])
    assert shown.exit_code == 0, shown.output
    (ask,) = json.loads(shown.stdout)["tool_approvals"]
    assert (ask["call_id"], ask["tool"], ask["status"], ask["note"]) == (
        "0#0.0", "send_payment", "approved", "approved by person: go ahead")
    text = CliRunner().invoke(app, ["show", str(task["id"])])
    assert text.exit_code == 0 and "tool approvals" in text.stdout
    assert "send_payment" in text.stdout and "approved" in text.stdout
