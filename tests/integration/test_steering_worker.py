"""A running worker under steering: a cancelled task stops, a paused tree starts no call.

Real PostgreSQL, a real worker loop in a thread, the fake Ollama server holding each
call, so calls are in flight when the person acts. Counts are read at the server.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agents.base import Agent, Result, TaskView
from agents.context import AgentContext
from runtime.config import load_settings
from runtime.errors import LeaseLost
from runtime.llm.gate import CallGate
from runtime.store.store import Store
from runtime.wiring import Runtime, build_runtime
from tests.factories import submit, terminal_event_counts
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401
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


@pytest.fixture
def runtime(db_url: str, store: Store, fake_ollama: FakeOllama) -> Iterator[Runtime]:
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "ollama",
                                  "ORGCHART_OLLAMA__URL": fake_ollama.url,
                                  "ORGCHART_LLM__CALL_RETRIES": "0"})
    yield build_runtime(settings, ["tests.support_agents"], store=store)


def wait_for(check: Callable[[], Any], seconds: float = 15.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("waited too long")


def test_a_cancelled_task_stops_and_starts_no_more_calls(runtime: Runtime,
                                                         fake_ollama: FakeOllama) -> None:
    fake_ollama.delay_seconds = 3.0
    SteerCaller.cancelled.clear()
    task = submit(runtime.store, "steer_caller", {"goal": "g", "calls": 5})
    worker = runtime.worker(["steer_caller"], maintenance=False, lease_seconds=30)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: fake_ollama.received >= 1)
        out = runtime.store.cancel(task["id"], note="stop it")
        received_at_cancel = fake_ollama.received
        # The worker stops the task's coroutine (its call in flight is cancelled) ...
        wait_for(lambda: worker.stopper.stopped == 1)
        assert SteerCaller.cancelled == [task["id"]]
        time.sleep(1.0)
        # ... and no call of it started after the cancel returned.
        assert fake_ollama.received == received_at_cancel
    finally:
        worker.stop("test")
        thread.join(15)
    assert out.cancelled == 1
    assert runtime.store.get(task["id"])["status"] == "cancelled"
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
        wait_for(lambda: fake_ollama.received >= 1)
        runtime.store.cancel(task["id"])
        wait_for(lambda: worker.stopper.stopped == 1)
    finally:
        worker.stop("test")
        thread.join(15)
    assert fake_ollama.received == 1


def test_a_paused_tree_starts_no_call_until_resumed(runtime: Runtime,
                                                    fake_ollama: FakeOllama) -> None:
    fake_ollama.delay_seconds = 0.5
    task = submit(runtime.store, "steer_caller", {"goal": "g", "calls": 3})
    worker = runtime.worker(["steer_caller", "judge"], maintenance=False, lease_seconds=30)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: fake_ollama.received >= 1)
        runtime.store.pause(task["id"])
        time.sleep(0.8)                      # the call in flight finishes and is recorded
        held = fake_ollama.received
        time.sleep(1.5)
        assert fake_ollama.received == held  # no new call while paused
        assert runtime.store.get(task["id"])["status"] == "running"  # lease kept
        runtime.store.resume(task["id"])
        wait_for(lambda: runtime.store.get(task["id"])["status"] in ("done", "failed"))
    finally:
        worker.stop("test")
        thread.join(15)
    assert runtime.store.get(task["id"])["status"] == "done"
    assert fake_ollama.received == 3


def test_the_gate_refuses_a_cancelled_task_without_calling(store: Store) -> None:
    task = submit(store, "echo")
    row = store.claim(["echo"], 1, "w", 30)[0]
    calls: list[int] = []

    def read(ids: Any) -> tuple[dict[uuid.UUID, tuple[str | None, bool]], Any]:
        rows, release = store.gate_calls_held(ids)
        return {i: (g.status, g.paused) for i, g in rows.items()}, release

    async def off_loop(fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def request() -> str:
        calls.append(1)
        return "sent"

    gate = CallGate(read, off_loop)
    assert asyncio.run(gate.send(row.id, asyncio.Semaphore(1), request)) == "sent"
    store.cancel(task["id"])
    with pytest.raises(LeaseLost, match="cancelled"):
        asyncio.run(gate.send(row.id, asyncio.Semaphore(1), request))
    assert calls == [1]
