"""Sync agents park on their model calls: the calls in flight are not bounded by threads.

A worker with ``sync_threads = 2`` serves twelve tasks of a plain ``def run`` agent whose
one call waits at the loopback model server; all twelve calls must be at the server at
once (a fixed pool of two threads would hold two), each task ends ``done`` with one
terminal event, and the extra threads leave the pool when the calls end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agents.base import Agent, Result, TaskView
from agents.context import AgentContext
from runtime.config import load_settings
from runtime.store.store import Store
from runtime.wiring import Runtime, build_runtime
from tests.factories import submit, terminal_event_counts
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401
from tests.support_agents import AnyInput, AnyOutput

TASKS = 12


class ParkedCaller(Agent):
    """``def run``: one blocking ``ctx.llm.complete``."""

    name = "parked_caller"
    input_model = AnyInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        return Result({"text": ctx.llm.complete(f"question of {task.id}").text})


@pytest.fixture
def runtime(db_url: str, store: Store, fake_ollama: FakeOllama) -> Iterator[Runtime]:
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "ollama",
                                  "ORGCHART_OLLAMA__URL": fake_ollama.url,
                                  "ORGCHART_OLLAMA__MAX_PARALLEL": "64",
                                  "ORGCHART_LLM__CALL_RETRIES": "0"})
    yield build_runtime(settings, ["tests.support_agents"], store=store)


def wait_for(check: Callable[[], Any], seconds: float = 20.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.02)
    raise AssertionError("waited too long")


def test_sync_agents_calls_are_all_in_flight_with_two_threads(
        runtime: Runtime, fake_ollama: FakeOllama) -> None:
    fake_ollama.delay_seconds = 2.0
    tasks = [submit(runtime.store, "parked_caller", {"goal": f"g{i}"}) for i in range(TASKS)]
    worker = runtime.worker(["parked_caller", "judge"], sync_threads=2, maintenance=False)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: fake_ollama.max_in_flight == TASKS)
        assert worker.agents.parked <= TASKS
        wait_for(lambda: all(runtime.store.get(t["id"])["status"] == "done" for t in tasks))
        wait_for(lambda: worker.agents.parked == 0)
    finally:
        worker.stop("test")
        thread.join(15)
    assert fake_ollama.received == TASKS
    counts = terminal_event_counts(runtime.store)
    assert all(counts[t["id"]] == 1 for t in tasks)
