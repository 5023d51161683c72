"""The heartbeat: keeps a worker's leases, and says which tasks were taken away.

Every third of ``lease_seconds`` :meth:`LeaseKeeper.beat_once` extends every lease the
worker holds in one statement (``task_heartbeat_leased``, guarded by the lease tokens).
A token the statement did not return is no longer this worker's: the reaper handed the
task back, the watchdog timed it out, or a person resolved it. Such a task is *lost*:
its ``lease_lost`` flag is set (its agent sees ``ctx.lease_lost``, its model calls raise
``LeaseLost``, its outcome will match no row) and every hook given to
:meth:`LeaseKeeper.on_lost` is called with the tasks newly lost. A hook may stop their
work at once with :meth:`~runtime.engine.worker.state.InFlight.abort` (their coroutine
is cancelled, nothing is written); :meth:`LeaseKeeper.lost` lists the tasks still held
whose lease is gone.

The heartbeat has a thread and a connection of its own while the worker runs, so a busy
pool never delays it past a lease.

Failure modes: a database error is counted and logged once per streak, never fatal.
While the database is away (a failover, a restart) the heartbeat tries again every
:data:`RETRY_SECONDS` instead of waiting a whole interval, so the leases are extended as
soon as the new primary takes writes: a failover shorter than the lease loses none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from runtime.engine.threads import ThreadRunner
from runtime.engine.worker.settings import DB_ERRORS
from runtime.engine.worker.state import DbHealth, Held, InFlight
from runtime.store.postgres.engines import create_db_engine
from runtime.store.store import Store

log = logging.getLogger(__name__)

#: Seconds between beats while the last one failed (the database is away).
RETRY_SECONDS = 0.5
#: Called with the tasks newly found lost (from the heartbeat's thread).
LostHook = Callable[[list[InFlight]], None]


class LeaseKeeper:
    """Extends the leases of what a worker holds; finds and reports the tasks lost.

    Args:
        store: the worker's store (its URL opens the heartbeat's own connection).
        held: what the worker holds.
        lease_seconds: how long each extension lasts.
        health: where database errors are counted.

    """

    def __init__(self, store: Store, held: Held, lease_seconds: float,
                 health: DbHealth) -> None:
        self.store = store
        self.held = held
        self.lease_seconds = lease_seconds
        self.health = health
        self._hooks: list[LostHook] = []
        self._own_store: Store | None = None
        self._thread: ThreadRunner | None = None
        #: The last beat failed: the next one comes after RETRY_SECONDS.
        self.failing = False

    @property
    def interval(self) -> float:
        """Seconds between beats: a third of the lease."""
        return self.lease_seconds / 3

    def on_lost(self, hook: LostHook) -> None:
        """Call ``hook(items)`` with the tasks each beat finds newly lost."""
        self._hooks.append(hook)

    def lost(self) -> list[InFlight]:
        """The tasks still held whose lease was taken away (their work must stop)."""
        return [i for i in self.held.items() if i.lease_lost.is_set()]

    def beat_once(self) -> int:
        """Extend every lease held; flag and report the tasks lost. Returns how many held."""
        items = self.held.items()
        if not items:
            return 0
        try:
            kept = (self._own_store or self.store).claims.heartbeat(
                [i.row.lease for i in items], self.lease_seconds)
        except DB_ERRORS as exc:
            self.failing = True
            self.health.error("heartbeat", exc)
            return 0
        self.failing = False
        self.health.ok("heartbeat")
        lost = [i for i in items
                # A task whose outcome was written while the beat ran is done, not lost;
                # one whose action waits for the writer may be written right now (the
                # write is fenced by the token: if the lease is gone, it is refused).
                if i.row.lease_token not in kept and not i.lease_lost.is_set()
                and i.action is None and i in self.held]
        for item in lost:
            item.lease_lost.set()
            log.warning("lease lost", extra={"task_id": str(item.row.id)})
        if lost:
            self._report(lost)
        return len(kept)

    def _report(self, lost: list[InFlight]) -> None:
        for hook in self._hooks:
            try:
                hook(lost)
            except Exception:  # a hook's bug must not stop the heartbeat
                log.exception("a lease-lost hook failed")

    def start(self, own_store: Store | None = None) -> None:
        """Open the heartbeat's own thread and connection (call before :meth:`run`).

        ``own_store`` is the store the beats write through (closed by :meth:`close`);
        by default a new one with one connection to the worker's database.
        """
        self._thread = ThreadRunner(1, "heartbeat")
        self._own_store = own_store or Store(create_db_engine(
            self.store.engine.url.render_as_string(hide_password=False), pool_size=1))

    async def run(self) -> None:
        """Beat every :attr:`interval` until cancelled; never dies of an error."""
        assert self._thread is not None, "start() first"
        while True:
            await asyncio.sleep(min(RETRY_SECONDS, self.interval) if self.failing
                                else self.interval)
            try:
                await self._thread.run(self.beat_once)
            except Exception as exc:  # never let the heartbeat die
                self.failing = True
                self.health.error("heartbeat", exc)

    def close(self) -> None:
        """Stop the thread and close the connection (after :meth:`run` was cancelled)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._own_store is not None:
            self._own_store.dispose()
            self._own_store = None
