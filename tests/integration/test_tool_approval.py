"""A tool that requires approval holds its task until a person approves the call.

A real worker runs the ``clerk`` agent (``tests/approval_agents.py``) on the
offline backend, which calls the clerk's one tool in its first round. The call needs
approval: the task goes to ``awaiting_approval`` naming the call, the tool has not run.
``approve`` makes it pending; the next delivery replays the recorded model call and
runs the tool once. ``reject`` fails the task and the tool never runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime.config import load_settings
from runtime.store.rows import NewTask
from runtime.store.store import Store
from runtime.wiring import Runtime, build_runtime
from tests.approval_agents import PAID


@pytest.fixture
def runtime(db_url: str, store: Store) -> Runtime:
    PAID.clear()
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "offline"})
    return build_runtime(settings, ["tests.approval_agents"], store=store)


def drive(runtime: Runtime, task_id: Any, until: str) -> dict[str, Any]:
    worker = runtime.worker(["clerk", "judge"], maintenance=False, listen=False)
    for _ in range(30):
        worker.run_once()
        row = runtime.store.get(task_id)
        if row["status"] == until:
            return row
    raise AssertionError(f"task is {runtime.store.get(task_id)['status']}, not {until}")


def test_an_approved_tool_call_runs_once_after_the_approval(runtime: Runtime) -> None:
    store = runtime.store
    task, _ = store.submit(NewTask(to_agent="clerk", type="task", payload={"goal": "ACME"}))
    held = drive(runtime, task["id"], "awaiting_approval")
    assert PAID == [] and held["lease_token"] is None
    hold = [e for e in store.events(task["id"]) if e["to_status"] == "awaiting_approval"]
    assert hold[0]["detail"].startswith("tool call 0#0.0 (send_payment) waits for a "
                                        "person's approval")
    assert store.tool_call_approved(task["id"], hold[0]["detail"]) is False
    assert store.approve(task["id"]).changed
    done = drive(runtime, task["id"], "done")
    assert len(PAID) == 1 and done["result"]["paid"] == [{"paid": True}]
    calls = store.model_calls(task["id"])
    # The first round was paid once and replayed after the approval (a replay's row is
    # written with the task's outcome, so it is the last).
    assert sorted((c["position"], c["replayed"]) for c in calls) == [
        ("0#0", False), ("0#0", True), ("0#1", False)]
    (step,) = store.steps(task["id"])
    assert (step["name"], step["status"], step["starts"]) == ("send_payment", "finished", 1)


def test_a_rejected_tool_call_never_runs(runtime: Runtime) -> None:
    store = runtime.store
    task, _ = store.submit(NewTask(to_agent="clerk", type="task", payload={"goal": "ACME"}))
    drive(runtime, task["id"], "awaiting_approval")
    assert store.reject(task["id"], "not this supplier").changed
    assert store.get(task["id"])["status"] == "failed"
    assert PAID == [] and store.steps(task["id"]) == []
