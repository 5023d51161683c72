"""Maintenance: the reaper, the watchdog and the fan-in sweeper; the locks that elect a process.

A part of the store (``store.hygiene``, :class:`Hygiene`). One pass runs all three in one
transaction under a transaction-level advisory lock, so one worker runs it and the others
skip; it takes back the tasks of dead workers too (:meth:`Hygiene.reap_dead`, which each
worker also runs on its own about twice a second: :mod:`runtime.store.sessions`). A job
that one process at a time should do for as long as it lives (the trace exporter) holds a
:class:`SessionLock` instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from runtime.store.database import Database
from runtime.store.queries import TEXT as _TEXT
from runtime.store.rows import Reaped, Swept, TimedOut
from runtime.store.sessions import LIVENESS_NAMESPACE
from runtime.store.transitions import Transitions

#: The advisory lock key of the maintenance pass (distinct from the orchestrator's fire lock).
MAINTENANCE_LOCK_KEY = int.from_bytes(hashlib.sha256(b"orgchart:maintenance").digest()[:8],
                                      "big", signed=True)


@dataclass(frozen=True)
class Maintained:
    """What one maintenance pass did (reaper, watchdog and sweeper, in one transaction)."""

    reaped: Reaped
    timed_out: TimedOut
    swept: Swept
    #: Questions to a person failed past their deadline (``no answer: deadline``).
    unanswered: tuple[uuid.UUID, ...] = ()


log = logging.getLogger(__name__)


class SessionLock:
    """A session-level advisory lock held on a connection of its own, for as long as wanted.

    :meth:`try_acquire` may be called on every pass of a loop: the connection is opened
    once and kept, and once the lock is held it answers True without a round trip.
    :meth:`release` closes the connection for real (it is not handed back to the pool),
    which ends the session and with it the lock, even when the unlock cannot run.
    """

    def __init__(self, engine: Engine, key: int) -> None:
        self._engine = engine
        self.key = key
        self.held = False
        self._conn: Connection | None = None

    def try_acquire(self) -> bool:
        """Take the lock if it is free; False when another session holds it or on an error."""
        if self.held:
            return True
        try:
            if self._conn is None:
                self._conn = self._engine.connect().execution_options(
                    isolation_level="AUTOCOMMIT")
            self.held = bool(self._conn.execute(_TEXT["session_lock_try"],
                                                {"key": self.key}).scalar())
        except sa.exc.DBAPIError:
            log.warning("could not try the advisory lock %s", self.key, exc_info=True)
            self.release()
        return self.held

    def release(self) -> None:
        """Give the lock up (if held) and close the connection."""
        if self._conn is not None:
            with contextlib.suppress(sa.exc.DBAPIError):
                if self.held:
                    self._conn.execute(_TEXT["session_lock_release"], {"key": self.key})
            with contextlib.suppress(sa.exc.DBAPIError):
                self._conn.invalidate()
                self._conn.close()
        self._conn = None
        self.held = False


class Hygiene:
    """The maintenance pass and its three parts, each also callable alone; session locks.

    ``store.hygiene``; ``transitions`` is the store's
    :class:`~runtime.store.transitions.Transitions`, whose fan-in (``children_ended``) the
    tasks failed here (poisoned, timed out, unanswered) go through, in this part's
    transaction.
    """

    def __init__(self, database: Database, transitions: Transitions) -> None:
        self.database = database
        self.transitions = transitions

    def session_lock(self, key: int) -> SessionLock:
        """A :class:`SessionLock` on ``key`` (not taken yet: call ``try_acquire``)."""
        return SessionLock(self.database.engine, key)

    def maintain(self, max_delivery: int, interval_seconds: float, *, reap_limit: int = 1000,
                 timeout_limit: int = 1000, sweep_limit: int = 10_000,
                 name: str = "maintenance") -> Maintained | None:
        """One maintenance pass for all workers: reaper, watchdog and sweeper, once per interval.

        Runs in one transaction under a transaction-level advisory lock: while one worker
        runs it the others skip, and a pass that ran less than ``interval_seconds`` ago
        (by the database clock) is not repeated. Returns None when skipped.
        """
        with self.database.transaction() as conn:
            began = conn.execute(_TEXT["maintenance_pass_begin"],
                                 {"key": MAINTENANCE_LOCK_KEY, "name": name,
                                  "interval": float(interval_seconds)}).first()
            if began is None:
                return None
            reaped = self._reap(conn, max_delivery, "reaper", reap_limit)
            # The liveness pass runs here too (every worker also runs it on its own,
            # ungated, about twice a second): the orchestrator's hygiene sees dead workers.
            dead = self._reap_dead(conn, max_delivery, "reaper", reap_limit)
            reaped = Reaped(released=reaped.released + dead.released,
                            poisoned=reaped.poisoned + dead.poisoned,
                            ids=reaped.ids + dead.ids)
            timed_out = self._time_out(conn, "watchdog", timeout_limit)
            swept = self._sweep(conn, "sweeper", sweep_limit)
            late = conn.execute(_TEXT["task_fail_unanswered"],  # questions past their deadline
                                {"worker": "watchdog", "limit": timeout_limit}).all()
            self.transitions.children_ended(conn, late, "watchdog")
        return Maintained(reaped, timed_out, swept, tuple(r.id for r in late))

    def reap(self, max_delivery: int, worker: str = "reaper", limit: int = 1000) -> Reaped:
        """Release expired leases; poison tasks delivered ``max_delivery`` times."""
        with self.database.transaction() as conn:
            return self._reap(conn, max_delivery, worker, limit)

    def _reap(self, conn: Connection, max_delivery: int, worker: str, limit: int) -> Reaped:
        rows = conn.execute(_TEXT["task_reap_expired"],
                            {"max_delivery": max_delivery, "worker": worker,
                             "limit": limit,
                             "poison_why": " and its lease expired each time"}).all()
        return self._reaped(conn, rows, worker)

    def reap_dead(self, max_delivery: int, worker: str = "reaper", limit: int = 1000, *,
                  on: Connection | None = None) -> Reaped:
        """Take back the tasks of workers whose session ended while this server ran.

        ``task_reap_dead_owners``: an owner whose ``worker_sessions`` row names this
        server's start and whose liveness lock nobody holds is dead; its tasks go back as
        the reaper sends expired ones, poison rule included. ``on``: run on this
        connection (a worker's liveness session, see :mod:`runtime.store.sessions`) in a
        transaction of its own, instead of one from the pool.
        """
        if on is None:
            with self.database.transaction() as conn:
                return self._reap_dead(conn, max_delivery, worker, limit)
        with on.begin():
            return self._reap_dead(on, max_delivery, worker, limit)

    def _reap_dead(self, conn: Connection, max_delivery: int, worker: str,
                   limit: int) -> Reaped:
        rows = conn.execute(_TEXT["task_reap_dead_owners"],
                            {"max_delivery": max_delivery, "worker": worker, "limit": limit,
                             "namespace": LIVENESS_NAMESPACE,
                             "poison_why": "; its worker died on the last"}).all()
        return self._reaped(conn, rows, worker)

    def _reaped(self, conn: Connection, rows: Sequence[Any], worker: str) -> Reaped:
        """What a reap returned; the parents of the tasks it poisoned hear of it (fan-in)."""
        self.transitions.children_ended(conn, [r for r in rows if r.to_status == "failed"], worker)
        poisoned = sum(1 for r in rows if r.to_status == "failed")
        return Reaped(released=len(rows) - poisoned, poisoned=poisoned,
                      ids=tuple(r.id for r in rows))

    def time_out(self, worker: str = "watchdog", limit: int = 1000) -> TimedOut:
        """Fail tasks running past their ``budget_seconds`` with ``error = 'timeout'``."""
        with self.database.transaction() as conn:
            return self._time_out(conn, worker, limit)

    def _time_out(self, conn: Connection, worker: str, limit: int) -> TimedOut:
        rows = conn.execute(_TEXT["task_fail_timed_out"],
                            {"worker": worker, "limit": limit}).all()
        self.transitions.children_ended(conn, rows, worker)
        return TimedOut(failed=len(rows), ids=tuple(r.id for r in rows))

    def sweep(self, worker: str = "sweeper", limit: int = 10_000) -> Swept:
        """Mark waiting parents whose children are all terminal ``ready_to_aggregate``."""
        with self.database.transaction() as conn:
            return self._sweep(conn, worker, limit)

    @staticmethod
    def _sweep(conn: Connection, worker: str, limit: int) -> Swept:
        rows = conn.execute(_TEXT["task_sweep_ready_parents"],
                            {"worker": worker, "limit": limit}).all()
        return Swept(ready=len(rows), ids=tuple(r.id for r in rows))
