"""Sync agents park on their model calls: the calls in flight are not bounded by threads.

A worker with ``sync_threads = 2`` serves twelve tasks of a plain ``def run`` agent whose
one call waits at the loopback model server; all twelve calls must be at the server at
once (a fixed pool of two threads would hold two), each task ends ``done`` with one
terminal event, and the extra threads leave the pool when the calls end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from agents.base import Agent, Result, TaskView
from agents.context import AgentContext
from runtime.wiring import Runtime
from tests.factories import submit, terminal_event_counts
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401
from tests.support import wait_until
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
def runtime(make_runtime: Callable[..., Runtime], fake_ollama: FakeOllama) -> Runtime:
    return make_runtime(ORGCHART_LLM__BACKEND="ollama", ORGCHART_OLLAMA__URL=fake_ollama.url,
                        ORGCHART_OLLAMA__MAX_PARALLEL="64", ORGCHART_LLM__CALL_RETRIES="0")


def test_sync_agents_calls_are_all_in_flight_with_two_threads(
        runtime: Runtime, fake_ollama: FakeOllama) -> None:
    fake_ollama.delay_seconds = 2.0
    tasks = [submit(runtime.store, "parked_caller", {"goal": f"g{i}"}) for i in range(TASKS)]
    worker = runtime.worker(["parked_caller", "judge"], sync_threads=2, maintenance=False)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: fake_ollama.max_in_flight == TASKS, timeout=20.0)
        assert worker.agents.parked <= TASKS
        wait_until(lambda: all(runtime.store.reads.get(t["id"])["status"] == "done" for t in tasks),
                   timeout=20.0)
        wait_until(lambda: worker.agents.parked == 0, timeout=20.0)
    finally:
        worker.stop("test")
        thread.join(15)
    assert fake_ollama.received == TASKS
    counts = terminal_event_counts(runtime.store)
    assert all(counts[t["id"]] == 1 for t in tasks)
