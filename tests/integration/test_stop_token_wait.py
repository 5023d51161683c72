"""A stopping worker hands back at once a task whose model call waits for its tenant's tokens.

A worker's stop gives in-flight work ``[worker] stop_grace_seconds`` to finish. A task
whose call waits for a dry token bucket (``[tenants.<name>] tokens_per_minute``) would
hold the stop for the whole grace and be handed back at its end anyway, since a bucket
can take minutes to refill. Here the worker's grace is 60 s and the bucket owes ten
minutes' worth: the worker hands the task back (``released by a worker shutting down``)
and stops long before the grace. The task's first call was recorded, so the next worker
replays it and pays only for the second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agents.base import Agent, Result, TaskView
from agents.context import AgentContext
from runtime.store.rows import Tenancy
from runtime.store.store import Store
from runtime.wiring import Runtime
from tests.factories import submit, terminal_event_counts
from tests.support_agents import AnyInput, AnyOutput

RATE = 60  # tokens a minute: one a second
GRACE = 60.0
#: Each call asks for more than the bucket holds: it takes a whole minute's worth.
MAX_TOKENS = RATE


class MeteredPair(Agent):
    """Two model calls of a metered tenant, one after the other."""

    name = "metered_pair"
    input_model = AnyInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        for i in range(2):
            ctx.llm.complete(f"metered call {i}: say something short", max_tokens=MAX_TOKENS)
        return Result({"calls": 2})


class AsyncMeteredPair(Agent):
    """:class:`MeteredPair` as an ``async def`` agent, awaited on the worker's loop."""

    name = "async_metered_pair"
    input_model = AnyInput
    output_model = AnyOutput

    async def run(self, ctx: AgentContext, task: TaskView) -> Result:
        for i in range(2):
            await ctx.llm.acomplete(f"metered call {i}: say something short",
                                    max_tokens=MAX_TOKENS)
        return Result({"calls": 2})


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime], store: Store, tmp_path: Path) -> Runtime:
    config = tmp_path / "orgchart.toml"
    config.write_text(f"[tenants.metered]\ntokens_per_minute = {RATE}\n"
                      f"[worker]\nstop_grace_seconds = {GRACE}\n")
    runtime = make_runtime([__name__], config=config)
    store.policies.tenancy = runtime.store.policies.tenancy = Tenancy.from_settings(
        runtime.settings)
    return runtime


def _calls(store: Store, task_id: Any, replayed: bool = False) -> int:
    """The task's answered model calls: paid ones, or (``replayed``) served from the record."""
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM model_calls WHERE task_id = :t AND error IS NULL "
            "AND replayed = :r"), {"t": task_id, "r": replayed}).scalar_one())


def _wait_for(what: Any, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("agent", ["metered_pair", "async_metered_pair"])
def test_a_task_waiting_for_tokens_is_handed_back_at_once_on_stop(runtime: Runtime,
                                                                  agent: str) -> None:
    store = runtime.store
    task = submit(store, agent, {"goal": "g"}, tenant="metered")
    worker = runtime.worker([agent], maintenance=False, listen=False)
    assert worker.config.worker.stop_grace_seconds == GRACE
    meter = runtime.llm_factory.calls.meter
    assert meter is not None
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        _wait_for(lambda: _calls(store, task["id"]) == 1)  # the first call was answered
        # The tenant now owes ten minutes' worth: the second call cannot start.
        assert store.spend.take_tenant_tokens("metered", 0, RATE, refund=-10 * RATE) == 0.0
        _wait_for(lambda: task["id"] in meter.waiting_tasks())
        stopped = time.monotonic()
        worker.stop("test")
        thread.join(GRACE / 2)
        assert not thread.is_alive(), "the stop waited for the grace"
        took = time.monotonic() - stopped
    finally:
        worker.stop("test")
        thread.join(GRACE + 5)
    assert worker.stats.outcomes == {} and worker.stats.dropped == 0  # nothing written
    print(f"\nstopped {took:.2f} s after the stop began (grace {GRACE:g} s)")
    row = store.reads.get(task["id"])
    assert row["status"] == "pending" and row["lease_owner"] is None
    assert worker.stats.released == 1
    assert [e["detail"] for e in store.reads.events(task["id"])][-1] == \
        "released by a worker shutting down"
    assert meter.waiting_tasks() == set()
    assert _calls(store, task["id"]) == 1  # the second call never started

    # The debt paid, the next worker replays the first call and pays for the second only.
    assert store.spend.take_tenant_tokens("metered", 0, RATE, refund=12 * RATE) == 0.0
    again = runtime.worker([agent, "judge"], maintenance=False, listen=False)
    _wait_for(lambda: again.run_once() == 1 or store.reads.get(task["id"])["status"] == "done")
    assert store.reads.get(task["id"])["status"] == "done"
    assert _calls(store, task["id"]) == 2  # paid: the first call once, the second
    assert _calls(store, task["id"], replayed=True) == 1
    assert terminal_event_counts(store) == {task["id"]: 1}
