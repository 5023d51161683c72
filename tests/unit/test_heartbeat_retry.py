"""The heartbeat keeps trying while the database is away (no server: a store that fails)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import psycopg

from runtime.engine.worker.leases import LeaseKeeper
from runtime.engine.worker.settings import WorkerStats
from runtime.engine.worker.state import DbHealth, Held, InFlight


class _Row:
    id = uuid.uuid4()
    lease_token = uuid.uuid4()
    lease = (id, lease_token)


class _AwayThenBack:
    """A store (and its claims part) whose heartbeat fails ``failures`` times, then holds."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.claims = self

    def heartbeat(self, leases: list[Any], lease_seconds: float) -> set[uuid.UUID]:
        self.calls += 1
        if self.calls <= self.failures:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return {token for _, token in leases}

    def dispose(self) -> None:
        """Nothing to close (no engine)."""


def test_a_failed_beat_is_retried_long_before_the_next_interval() -> None:
    store = _AwayThenBack(failures=2)
    held = Held()
    held.add(InFlight(_Row(), "run", threading.Event()))  # type: ignore[arg-type]
    stats = WorkerStats()
    keeper = LeaseKeeper(store, held, lease_seconds=60.0, health=DbHealth(stats))  # type: ignore[arg-type]
    assert keeper.beat_once() == 0 and keeper.failing  # the database is away

    async def run_until_back() -> None:
        keeper.start(own_store=store)  # type: ignore[arg-type]  # no engine to open
        # Two retries RETRY_SECONDS apart take about 1 s; the next interval is 20 s.
        deadline = asyncio.get_running_loop().time() + keeper.interval / 2
        job = asyncio.ensure_future(keeper.run())
        try:
            while store.calls < 3 or keeper.failing:
                assert not job.done(), job
                assert asyncio.get_running_loop().time() < deadline, \
                    "not retried long before the next interval"
                await asyncio.sleep(0.02)
        finally:
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
            keeper.close()

    asyncio.run(run_until_back())
    assert store.calls >= 3 and not keeper.failing and stats.db_errors == 2
