"""Forks: where a replayed call's row is written, and tool steps replayed in a branch.

A replayed call (a branch task asking what its counterpart asked) is written with the
task's outcome, in its transaction (runtime.llm.calls.HeldReplays); a delivery that dies
before its outcome leaves no row, and the next delivery replays the call again.
"""

from __future__ import annotations

import threading
from decimal import Decimal

from runtime.forks import fork
from runtime.store.rows import RunOutcome
from runtime.wiring import Runtime
from tests.factories import expire_leases, submit
from tests.integration.test_forks import drain, runtime  # noqa: F401 (a fixture)


def test_a_replayed_call_is_written_with_the_outcome_and_never_twice(
        runtime: Runtime) -> None:  # noqa: F811
    store = runtime.store
    original = submit(store, "fork_writer", {"goal": "one part"})
    drain(runtime)
    (paid,) = store.model_calls(original["id"])
    branch = fork(store, runtime.registry, runtime.settings, original["id"])

    # A first delivery replays the call, then dies before its outcome is written.
    (row,) = store.claim(["fork_writer"], 1, "w-dies", 30)
    action = runtime.executor().execute(row, threading.Event())
    assert isinstance(action, RunOutcome) and action.stamp is not None
    (held,) = action.stamp["replays"]
    assert held["request_hash"] == paid["request_hash"] and held["attempt"] == 1
    assert store.model_calls(branch["id"]) == []

    expire_leases(store, where=f"id = '{branch['id']}'")
    store.reap(max_delivery=10)
    drain(runtime)

    task = store.get(branch["id"])
    assert task["status"] == "done" and task["own_tokens"] == 0 and task["spent_usd"] == 0
    (replayed,) = store.model_calls(branch["id"])
    assert replayed["replayed"] and replayed["attempt"] == 2 and replayed["call_try"] == 0
    assert Decimal(replayed["cost_usd"]) == 0 and replayed["prompt_tokens"] == 0
    assert replayed["response"] == paid["response"]
    assert replayed["request_hash"] == paid["request_hash"]
    assert replayed["created_at"] <= task["completed_at"]
    # A task that only replayed shows the route and model of the call it replayed.
    assert (task["route"], task["model"]) == (paid["route"], paid["model"])
    assert store.model_calls(original["id"]) == [paid]
