"""A running worker under steering: a cancelled task stops, a paused tree starts no call.

Real PostgreSQL, a real worker loop in a thread, the fake Ollama server holding each
call, so calls are in flight when the person acts. Counts are read at the server.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from agents.base import Agent, Result, TaskView
from agents.context import AgentContext
from runtime.errors import LeaseLost
from runtime.llm.gate import CallGate
from runtime.store.store import Store
from runtime.wiring import Runtime
from tests.factories import expire_leases, hand_over, submit, terminal_event_counts
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401
from tests.support import wait_until
from tests.support_agents import AnyInput, AnyOutput


class SteerCaller(Agent):
    """``async def run``: makes ``calls`` model calls one after another."""

    name = "steer_caller"
    input_model = AnyInput
    output_model = AnyOutput
    cancelled: list[uuid.UUID] = []

    async def run(self, ctx: AgentContext, task: TaskView) -> Result:
        try:
            for i in range(int(task.payload.get("calls", 1))):
                await ctx.llm.acomplete(f"question {i} of {task.id}")
        except asyncio.CancelledError:
            type(self).cancelled.append(task.id)
            raise
        return Result({"answered": True})


class TwoCalls(Agent):
    """Makes a model call, waits for the test's ``go``, then makes another."""

    name = "two_calls"
    input_model = AnyInput
    output_model = AnyOutput
    between = threading.Event()
    go = threading.Event()

    async def run(self, ctx: AgentContext, task: TaskView) -> Result:
        await ctx.llm.acomplete(f"first of {task.id}")
        type(self).between.set()  # the first call is answered and charged
        await asyncio.to_thread(type(self).go.wait, 15)
        await ctx.llm.acomplete(f"second of {task.id}")
        return Result({"answered": True})


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime], fake_ollama: FakeOllama) -> Runtime:
    return make_runtime(ORGCHART_LLM__BACKEND="ollama", ORGCHART_OLLAMA__URL=fake_ollama.url,
                        ORGCHART_LLM__CALL_RETRIES="0")


def recorded_calls(store: Store, task_id: Any) -> int:
    """The task's model calls written to ``model_calls``."""
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM model_calls WHERE task_id = :t"),
                                {"t": task_id}).scalar_one())


def test_a_cancelled_task_stops_and_starts_no_more_calls(runtime: Runtime,
                                                         fake_ollama: FakeOllama) -> None:
    fake_ollama.delay_seconds = 3.0
    SteerCaller.cancelled.clear()
    task = submit(runtime.store, "steer_caller", {"goal": "g", "calls": 5})
    worker = runtime.worker(["steer_caller"], maintenance=False, lease_seconds=30)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: fake_ollama.received >= 1)
        out = runtime.store.steering.cancel(task["id"], note="stop it")
        received_at_cancel = fake_ollama.received
        # The worker stops the task's coroutine (its call in flight is cancelled) ...
        wait_until(lambda: worker.stopper.stopped == 1)
        assert SteerCaller.cancelled == [task["id"]]
        # ... and once the worker has let the task go, no call of it started after the
        # cancel returned.
        wait_until(lambda: len(worker.held) == 0, what="the worker to let the task go")
        assert fake_ollama.received == received_at_cancel
    finally:
        worker.stop("test")
        thread.join(15)
    assert out.cancelled == 1
    assert runtime.store.reads.get(task["id"])["status"] == "cancelled"
    assert terminal_event_counts(runtime.store)[task["id"]] == 1


def test_the_poll_alone_stops_a_cancelled_task(runtime: Runtime,
                                               fake_ollama: FakeOllama) -> None:
    """No notification (listen off), a long heartbeat: the stop check still finds it."""
    fake_ollama.delay_seconds = 3.0
    task = submit(runtime.store, "steer_caller", {"goal": "g", "calls": 2})
    worker = runtime.worker(["steer_caller"], maintenance=False, listen=False,
                            lease_seconds=300)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: fake_ollama.received >= 1)
        runtime.store.steering.cancel(task["id"])
        wait_until(lambda: worker.stopper.stopped == 1)
    finally:
        worker.stop("test")
        thread.join(15)
    assert fake_ollama.received == 1


def test_a_paused_tree_starts_no_call_until_resumed(runtime: Runtime,
                                                    fake_ollama: FakeOllama,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fake_ollama.delay_seconds = 0.5
    task = submit(runtime.store, "steer_caller", {"goal": "g", "calls": 3})
    # The gate's reads (through the real database): how often it answered "paused" for
    # this task, the positive sign that the next call reached the gate and was held.
    paused_answers: list[int] = []
    read = runtime.store.steering.gate_calls_held

    def counting(ids: Any) -> Any:
        rows, release = read(ids)
        paused_answers.extend(1 for i, g in rows.items() if i == task["id"] and g.paused)
        return rows, release

    monkeypatch.setattr(runtime.store.steering, "gate_calls_held", counting)
    worker = runtime.worker(["steer_caller", "judge"], maintenance=False, lease_seconds=30)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: fake_ollama.received >= 1)
        runtime.store.steering.pause(task["id"])
        # the call in flight finishes and is recorded
        wait_until(lambda: fake_ollama.in_flight == 0
                   and recorded_calls(runtime.store, task["id"]) >= 1)
        held, answered = fake_ollama.received, len(paused_answers)
        # The next call asked the gate, was told "paused", waited and asked again: it had
        # its chance to be sent, twice, and was not.
        wait_until(lambda: len(paused_answers) >= answered + 2, what="the gate's answers")
        assert fake_ollama.received == held  # no new call while paused
        assert runtime.store.reads.get(task["id"])["status"] == "running"  # lease kept
        runtime.store.steering.resume(task["id"])
        wait_until(lambda: runtime.store.reads.get(task["id"])["status"] in ("done", "failed"))
    finally:
        worker.stop("test")
        thread.join(15)
    assert runtime.store.reads.get(task["id"])["status"] == "done"
    assert fake_ollama.received == 3


def test_a_task_taken_away_starts_no_call_before_its_heartbeat_says_so(
        runtime: Runtime, fake_ollama: FakeOllama) -> None:
    """A partition healed: another worker holds the task, this one's heartbeat is far off.

    Its next model call is refused by the gate (the lease token no longer matches), not
    sent and paid twice; the new holder's lease is untouched.
    """
    TwoCalls.between.clear()
    TwoCalls.go.clear()
    task = submit(runtime.store, "two_calls", {"goal": "g"})
    worker = runtime.worker(["two_calls"], maintenance=False, listen=False,
                            lease_seconds=300)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert TwoCalls.between.wait(15)
        token = hand_over(runtime.store, task["id"])
        TwoCalls.go.set()
        wait_until(lambda: worker.stats.dropped >= 1)
        assert fake_ollama.received == 1
        row = runtime.store.reads.get(task["id"])
        assert (row["status"], row["lease_token"], row["lease_owner"]) == (
            "running", token, "w-other")
    finally:
        worker.stop("test")
        thread.join(15)
    assert fake_ollama.received == 1


def store_gate(store: Store, calls: list[int]) -> tuple[CallGate, Callable[[], Any]]:
    """A gate reading ``store`` (as the ledger does), and a request that counts its sends."""
    def read(ids: Any) -> tuple[dict[uuid.UUID, Any], Any]:
        rows, release = store.steering.gate_calls_held(ids)
        return {i: (g.status, g.paused, g.lease_token) for i, g in rows.items()}, release

    async def off_loop(fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def request() -> str:
        calls.append(1)
        return "sent"

    return CallGate(read, off_loop), request


def test_the_gate_refuses_a_caller_whose_lease_was_taken(store: Store) -> None:
    """The gate compares the caller's lease token with the task's holder, per caller."""
    submit(store, "echo")
    first = store.claims.claim(["echo"], 1, "w-first", 30)[0]
    calls: list[int] = []
    gate, request = store_gate(store, calls)
    assert asyncio.run(gate.send(first.id, asyncio.Semaphore(1), request,
                                 lease_token=first.lease_token)) == "sent"
    assert expire_leases(store) == 1
    store.hygiene.reap(max_delivery=10)
    second = store.claims.claim(["echo"], 1, "w-second", 30)[0]
    assert second.id == first.id and second.lease_token != first.lease_token
    with pytest.raises(LeaseLost, match="taken away"):
        asyncio.run(gate.send(first.id, asyncio.Semaphore(1), request,
                              lease_token=first.lease_token))
    # Refused for the old holder only: the task is not stopped, its new holder calls.
    assert not gate.is_stopped(first.id)
    assert asyncio.run(gate.send(first.id, asyncio.Semaphore(1), request,
                                 lease_token=second.lease_token)) == "sent"
    assert calls == [1, 1]


def test_the_gate_refuses_a_cancelled_task_without_calling(store: Store) -> None:
    task = submit(store, "echo")
    row = store.claims.claim(["echo"], 1, "w", 30)[0]
    calls: list[int] = []
    gate, request = store_gate(store, calls)
    assert asyncio.run(gate.send(row.id, asyncio.Semaphore(1), request)) == "sent"
    store.steering.cancel(task["id"])
    with pytest.raises(LeaseLost, match="cancelled"):
        asyncio.run(gate.send(row.id, asyncio.Semaphore(1), request))
    assert calls == [1]
