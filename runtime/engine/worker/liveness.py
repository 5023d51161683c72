"""Liveness: PostgreSQL sees this worker alive; the worker takes back dead workers' tasks.

While a worker runs, :class:`Liveness` keeps a :class:`~runtime.store.sessions.
LivenessSession` registered (a session-level advisory lock on a connection of its own,
and the owner's ``worker_sessions`` row): if the process dies, PostgreSQL frees the lock
as it ends the session. Every :data:`LIVENESS_SECONDS` it runs, on that same connection,
the dead-owner pass (``task_reap_dead_owners``): the tasks of owners registered on this
server run whose lock nobody holds go back to the queue, fenced by their lease tokens.
The pass is cheap (a look at ``pg_locks`` and the small ``worker_sessions`` table; the
tasks are read only when an owner is dead) and not gated by ``maintenance_interval``:
every live worker runs it, so a dead worker's tasks come back within about half a second
of its session's end. Running it on the lock's connection also checks that connection:
when it broke (a restart, a failover, a network break), the next beat reconnects, takes
the lock and registers again.

:meth:`Liveness.begin` runs before the worker's first claim: the dead-owner pass and the
expired-lease reaper (ungated), then the registration. A restarted worker thus takes back
its predecessor's work at once, even under the same ``--worker-id`` (whose lock is free
until this incarnation takes it), and ``orgchart worker --once`` finds the tasks a
SIGKILLed worker left, whether their lease expired or not.

A worker with ``maintenance`` off registers (others may take back its tasks if it dies)
but runs no pass. Failure modes: a database error is counted and logged once per streak,
never fatal; the beat tries again at its next interval.
"""

from __future__ import annotations

import asyncio
import logging

from runtime.engine.threads import ThreadRunner
from runtime.engine.worker.settings import DB_ERRORS, WorkerConfig, WorkerStats
from runtime.engine.worker.state import DbHealth
from runtime.store.postgres.engines import create_db_engine
from runtime.store.rows import Reaped
from runtime.store.sessions import LivenessSession
from runtime.store.store import Store

log = logging.getLogger(__name__)

#: Seconds between two dead-owner passes of one worker (and checks of its own session).
LIVENESS_SECONDS = 0.5
#: The name the passes write in ``task_events.worker`` (the audit knows it as maintenance).
REAPER = "reaper"


class Liveness:
    """Keeps a worker registered as alive; takes back the tasks of dead ones.

    Args:
        store: the worker's store (its URL opens the session's own connection).
        config: the worker's options (``worker_id`` is the owner; ``maintenance`` says
            whether to run the passes; ``max_delivery`` the poison rule).
        stats: where what the passes took back is counted.
        health: where database errors are counted.

    """

    def __init__(self, store: Store, config: WorkerConfig, stats: WorkerStats,
                 health: DbHealth) -> None:
        self.store = store
        self.config = config
        self.stats = stats
        self.health = health
        self.interval = LIVENESS_SECONDS
        self._own: Store | None = None
        self._session: LivenessSession | None = None
        self._thread: ThreadRunner | None = None

    def start(self) -> None:
        """Open the thread and the session's own engine (call before :meth:`begin`)."""
        self._thread = ThreadRunner(1, "liveness")
        self._own = Store(create_db_engine(
            self.store.engine.url.render_as_string(hide_password=False), pool_size=1))
        self._session = LivenessSession(self._own.engine, self.config.worker_id)

    async def begin(self) -> None:
        """Before the first claim: take back what dead workers left, then register."""
        assert self._thread is not None, "start() first"
        await self._thread.run(self.first_pass)

    def first_pass(self) -> None:
        """The dead-owner pass and the expired-lease reaper, then the registration."""
        assert self._own is not None and self._session is not None, "start() first"
        try:
            if self.config.maintenance:
                self._count(self._own.hygiene.reap_dead(self.config.retry.max_delivery, REAPER,
                                                        on=self._session.connection))
                self._count(self._own.hygiene.reap(self.config.retry.max_delivery, REAPER))
            self._session.register()
            self.health.ok("liveness")
        except DB_ERRORS as exc:
            self._session.failed(exc)
            self.health.error("liveness", exc)

    def beat_once(self) -> Reaped | None:
        """Register again if the session broke; run the dead-owner pass on it."""
        assert self._own is not None and self._session is not None, "start() first"
        try:
            self._session.ensure()
            done = None
            if self.config.maintenance:
                done = self._own.hygiene.reap_dead(self.config.retry.max_delivery, REAPER,
                                                   on=self._session.connection)
                self._count(done)
            self.health.ok("liveness")
            return done
        except DB_ERRORS as exc:
            self._session.failed(exc)
            self.health.error("liveness", exc)
            return None

    def _count(self, done: Reaped) -> None:
        self.stats.reaped += done.released
        self.stats.poisoned += done.poisoned
        if done.ids:
            log.info(f"took back {len(done.ids)} task(s) of dead workers")

    async def run(self) -> None:
        """Beat every :attr:`interval` until cancelled; never dies of an error."""
        assert self._thread is not None, "start() first"
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self._thread.run(self.beat_once)
            except Exception as exc:  # never let liveness die
                self.health.error("liveness", exc)

    def close(self) -> None:
        """End the session (its lock goes with it) and stop the thread."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._session is not None:
            self._session.close()
            self._session = None
        if self._own is not None:
            self._own.dispose()
            self._own = None
