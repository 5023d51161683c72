"""Forks: where a replayed call's row is written; steps and tool calls replayed in a branch.

A replayed call (a branch task asking what its counterpart asked) is written with the
task's outcome, in its transaction (runtime.llm.call_records.HeldReplays); a delivery that dies
before its outcome leaves no row, and the next delivery replays the call again.
"""

from __future__ import annotations

import threading
from decimal import Decimal
from typing import Any

import pytest

from runtime.forks import fork
from runtime.llm.backends.ollama import OllamaBackend
from runtime.llm.ledger import RecordReader
from runtime.store.rows import RunOutcome
from runtime.wiring import Runtime
from tests.factories import expire_leases, submit
from tests.fake_ollama import FakeOllama, calls_until, fake_ollama_server  # noqa: F401
from tests.fork_agents import STEP_EFFECTS
from tests.integration.test_forks import drain, runtime  # noqa: F401 (a fixture)
from tests.integration.test_tools import PROMPT, Ledger, llm_for


def test_a_replayed_call_is_written_with_the_outcome_and_never_twice(
        runtime: Runtime) -> None:  # noqa: F811
    store = runtime.store
    original = submit(store, "fork_writer", {"goal": "one part"})
    drain(runtime)
    (paid,) = store.reads.model_calls(original["id"])
    branch = fork(store, runtime.registry, runtime.settings, original["id"])

    # A first delivery replays the call, then dies before its outcome is written.
    (row,) = store.claims.claim(["fork_writer"], 1, "w-dies", 30)
    action = runtime.executor().execute(row, threading.Event())
    assert isinstance(action, RunOutcome) and action.stamp is not None
    (held,) = action.stamp["replays"]
    assert held["request_hash"] == paid["request_hash"] and held["attempt"] == 1
    assert store.reads.model_calls(branch["id"]) == []

    expire_leases(store, where=f"id = '{branch['id']}'")
    store.hygiene.reap(max_delivery=10)
    drain(runtime)

    task = store.reads.get(branch["id"])
    assert task["status"] == "done" and task["own_tokens"] == 0 and task["spent_usd"] == 0
    (replayed,) = store.reads.model_calls(branch["id"])
    assert replayed["replayed"] and replayed["attempt"] == 2 and replayed["call_try"] == 0
    assert Decimal(replayed["cost_usd"]) == 0 and replayed["prompt_tokens"] == 0
    assert replayed["response"] == paid["response"]
    assert replayed["request_hash"] == paid["request_hash"]
    assert replayed["created_at"] <= task["completed_at"]
    # A task that only replayed shows the route and model of the call it replayed.
    assert (task["route"], task["model"]) == (paid["route"], paid["model"])
    assert store.reads.model_calls(original["id"]) == [paid]


def test_a_branch_replays_the_steps_its_counterpart_finished_with_the_same_arguments(
        runtime: Runtime) -> None:  # noqa: F811
    store = runtime.store
    STEP_EFFECTS.clear()
    original = submit(store, "fork_stepper", {"query": "tides", "post": "report"})
    drain(runtime)
    assert STEP_EFFECTS == [("lookup", "tides"), ("post", "report")]
    before = [dict(s) for s in store.steps.for_task(original["id"])]

    rerun = fork(store, runtime.registry, runtime.settings, original["id"])
    drain(runtime)
    assert STEP_EFFECTS == [("lookup", "tides"), ("post", "report")]  # nothing ran again
    task = store.reads.get(rerun["id"])
    assert task["status"] == "done"
    assert task["result"] == store.reads.get(original["id"])["result"]
    steps = store.steps.for_task(rerun["id"])
    assert [(s["name"], s["status"], s["starts"], s["replays"]) for s in steps] == [
        ("lookup", "finished", 0, 1), ("post", "finished", 0, 1)]

    # Another query: the look-up's argument changed, so it runs; the post did not.
    changed = fork(store, runtime.registry, runtime.settings, original["id"],
                   payload={"query": "currents", "post": "report"})
    drain(runtime)
    assert STEP_EFFECTS[2:] == [("lookup", "currents")]
    assert store.reads.get(changed["id"])["result"]["found"]["answer"] == "found currents"
    steps = store.steps.for_task(changed["id"])
    assert [(s["name"], s["starts"], s["replays"]) for s in steps] == [
        ("lookup", 1, 0), ("post", 0, 1)]
    assert [dict(s) for s in store.steps.for_task(original["id"])] == before


def test_a_branch_replays_tool_calls_with_unchanged_arguments_and_runs_changed_ones(
        runtime: Runtime, fake_ollama: FakeOllama) -> None:  # noqa: F811
    store = runtime.store
    backend = OllamaBackend(fake_ollama.url, 5.0)
    fake_ollama.tool_plan = calls_until(2, "lookup")
    effects = Ledger()
    original = submit(store, "fork_writer", {"goal": "numbers"})
    (row,) = store.claims.claim(["fork_writer"], 1, "w", 30)
    first = llm_for(store, row, backend).complete(PROMPT, tools=[effects.tool()])
    assert [n for _, n in effects.lines] == [0, 1] and first.tool_rounds == 2

    # The same conversation: every round and every tool call is served from the record.
    branch = fork(store, runtime.registry, runtime.settings, original["id"])
    (row,) = store.claims.claim(["fork_writer"], 1, "w", 30)
    assert row["id"] == branch["id"]
    again = llm_for(store, row, backend).complete(PROMPT, tools=[effects.tool()])
    assert [n for _, n in effects.lines] == [0, 1]  # no tool ran
    assert [t.replayed for t in again.tool_results] == [True, True]
    assert [t.result for t in again.tool_results] == [t.result for t in first.tool_results]
    assert all(c["replayed"] for c in store.reads.model_calls(branch["id"]))

    # Another prompt: the rounds are paid; the first tool call asks what the counterpart
    # asked (n = 0) and is replayed, the second asks n = 7 instead of 1 and runs.
    fake_ollama.tool_plan = calls_until(2, "lookup", arguments=lambda i: {"n": 7 * i})
    other = fork(store, runtime.registry, runtime.settings, original["id"])
    (row,) = store.claims.claim(["fork_writer"], 1, "w", 30)
    assert row["id"] == other["id"]
    changed = llm_for(store, row, backend).complete(PROMPT + " again",
                                                    tools=[effects.tool()])
    assert [n for _, n in effects.lines] == [0, 1, 7]
    assert [t.replayed for t in changed.tool_results] == [True, False]
    steps = {s["tool_call_id"]: s for s in store.steps.for_task(other["id"])}
    assert (steps["0#0.0"]["replays"], steps["0#1.0"]["starts"]) == (1, 1)


def test_a_branch_claim_carries_its_counterparts_replies_and_needs_no_look_up(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    store = runtime.store
    reads: list[str] = []
    read = RecordReader.read

    async def counted(self: RecordReader, task_id: Any, phase: str, position: str,
                      hashes: Any, counterpart: Any = None) -> Any:
        reads.append(position)
        return await read(self, task_id, phase, position, hashes, counterpart)

    monkeypatch.setattr(RecordReader, "read", counted)
    original = submit(store, "fork_writer", {"goal": "one part"})
    drain(runtime)
    (paid,) = store.reads.model_calls(original["id"])
    reads.clear()

    # An unchanged re-run: the claim brings the counterpart's reply; no look-up is made.
    branch = fork(store, runtime.registry, runtime.settings, original["id"])
    (row,) = store.claims.claim(["fork_writer"], 1, "w-1", 30)
    assert row.recorded_calls is False and row.counterpart_calls is not None
    (carried,) = row.counterpart_calls
    assert (carried["id"], carried["position"], carried["request_hash"]) == (
        paid["id"], paid["position"], paid["request_hash"])
    action = runtime.executor().execute(row, threading.Event())
    assert isinstance(action, RunOutcome) and action.stamp is not None
    (held,) = action.stamp["replays"]
    assert held["request_hash"] == paid["request_hash"] and reads == []

    # A changed request is not replayed from the carried rows: its call is made (paid).
    changed = fork(store, runtime.registry, runtime.settings, original["id"],
                   payload={"goal": "another part"})
    (row,) = store.claims.claim(["fork_writer"], 1, "w-2", 30)
    assert row.id == changed["id"] and row.counterpart_calls
    action = runtime.executor().execute(row, threading.Event())
    assert isinstance(action, RunOutcome) and action.stamp is not None
    assert action.stamp.get("replays") in (None, [])
    (own,) = store.reads.model_calls(changed["id"])
    assert not own["replayed"] and own["request_hash"] != paid["request_hash"]

    # Its redelivery has a reply of its own on record: it is looked up (own first).
    expire_leases(store, where=f"id = '{changed['id']}'")
    store.hygiene.reap(max_delivery=10)
    (row,) = store.claims.claim(["fork_writer"], 1, "w-3", 30)
    assert row.id == changed["id"] and row.recorded_calls is True
    action = runtime.executor().execute(row, threading.Event())
    assert isinstance(action, RunOutcome) and action.stamp is not None
    (held,) = action.stamp["replays"]
    assert held["request_hash"] == own["request_hash"] and reads == [own["position"]]
    assert store.reads.get(branch["id"])["status"] == "running"  # its outcome was not applied
