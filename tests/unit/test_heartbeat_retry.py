"""The heartbeat keeps trying while the database is away (no server: a store that fails)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import psycopg

from runtime.engine.worker.leases import RETRY_SECONDS, LeaseKeeper
from runtime.engine.worker.settings import WorkerStats
from runtime.engine.worker.state import DbHealth, Held, InFlight


class _Row:
    id = uuid.uuid4()
    lease_token = uuid.uuid4()
    lease = (id, lease_token)


class _AwayThenBack:
    """A store whose heartbeat fails ``failures`` times, then keeps every lease."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def heartbeat(self, leases: list[Any], lease_seconds: float) -> set[uuid.UUID]:
        self.calls += 1
        if self.calls <= self.failures:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return {token for _, token in leases}


def test_a_failed_beat_is_retried_long_before_the_next_interval() -> None:
    store = _AwayThenBack(failures=2)
    held = Held()
    held.add(InFlight(_Row(), "run", threading.Event()))  # type: ignore[arg-type]
    stats = WorkerStats()
    keeper = LeaseKeeper(store, held, lease_seconds=60.0, health=DbHealth(stats))  # type: ignore[arg-type]
    keeper._own_store = store  # type: ignore[assignment]  # no engine to open
    assert keeper.beat_once() == 0 and keeper.failing  # the database is away
    keeper.start = lambda: None  # type: ignore[method-assign]

    async def run_a_while() -> None:
        from runtime.engine.threads import ThreadRunner

        keeper._thread = ThreadRunner(1, "heartbeat")
        job = asyncio.ensure_future(keeper.run())
        await asyncio.sleep(RETRY_SECONDS * 4)  # the interval is 20 s
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        keeper._thread.shutdown(wait=True)

    asyncio.run(run_a_while())
    assert store.calls >= 3, store.calls  # retried (and succeeded) within seconds
    assert not keeper.failing and stats.db_errors == 2
