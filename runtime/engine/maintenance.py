"""Maintenance: the reaper, the watchdog and the fan-in sweeper.

Each service takes what it needs (the ``[retry]`` section, a batch limit) and has a
``run_once()`` that the worker's loop, the orchestrator's hygiene step and the tests call,
and returns what it did.

- **Reaper.** A worker that dies (SIGKILL, OOM, lost machine) stops renewing its leases.
  Where PostgreSQL saw its session end, every live worker's liveness pass takes its tasks
  back within about a second (:mod:`runtime.engine.worker.liveness`; the combined pass
  below runs it too). Otherwise, once a lease expires, ``run_once()`` releases the task:
  ``pending`` for a run, ``ready_to_aggregate`` for an aggregate, an unleased ``judging``
  for the judge stage. A task already delivered ``max_delivery`` times is poison and
  ends ``failed`` with an error that says so. Two reapers at once skip each other's
  rows (SKIP LOCKED), and a heartbeat that lands first keeps its task (the expiry is
  re-checked in the UPDATE).
- **Watchdog** (seed 003). Fails tasks running past their ``budget_seconds`` with
  ``error = 'timeout'`` and clears the lease token, so the late worker's completion
  matches no row and changes nothing. The parent's fan-in follows in the same
  transaction.
- **Sweeper** (seed 003). A parent that delegated waits in ``waiting``; the transaction
  that finishes its last child flips it at once. ``run_once()`` is the safety net for
  anything that path missed (a crash between statements, a child finished by hand):
  set-based, one statement backed by the partial index on ``waiting`` rows and the
  ``(parent_id, status)`` index; the UPDATE re-checks ``status = 'waiting'``.

The worker runs the three together through :class:`Maintenance`: one pass per
``interval`` across every worker (a transaction-level advisory lock plus the time of the
last pass, in the database), so a fleet of a hundred workers does not reap a hundred times
a second. The watchdog reads the indexed ``deadline_at`` (set at claim).

Failure modes: none of their own; concurrent passes skip each other's rows.
"""

from __future__ import annotations

from runtime.config import RetrySettings
from runtime.store.rows import Reaped, Swept, TimedOut
from runtime.store.store import Maintained, Store

REAP_BATCH_LIMIT = 1000
WATCHDOG_BATCH_LIMIT = 1000
SWEEP_INTERVAL_SECONDS = 1.0
SWEEP_BATCH_LIMIT = 10_000
#: The names the services write in ``task_events.worker``.
REAPER, WATCHDOG, SWEEPER = "reaper", "watchdog", "sweeper"


class Reaper:
    """Releases expired leases; poisons tasks past ``[retry] max_delivery``."""

    def __init__(self, store: Store, retry: RetrySettings, *, worker: str = REAPER,
                 batch_limit: int = REAP_BATCH_LIMIT) -> None:
        self.store = store
        self.retry = retry
        self.worker = worker
        self.batch_limit = batch_limit

    def run_once(self) -> Reaped:
        """One pass over expired leases; returns what it released and poisoned."""
        return self.store.hygiene.reap(self.retry.max_delivery, worker=self.worker,
                                       limit=self.batch_limit)


class Watchdog:
    """Times out tasks that ran past their budget."""

    def __init__(self, store: Store, *, worker: str = WATCHDOG,
                 batch_limit: int = WATCHDOG_BATCH_LIMIT) -> None:
        self.store = store
        self.worker = worker
        self.batch_limit = batch_limit

    def run_once(self) -> TimedOut:
        """One pass; returns how many tasks it failed."""
        return self.store.hygiene.time_out(worker=self.worker, limit=self.batch_limit)


class Sweeper:
    """Flips waiting parents whose children are all terminal."""

    def __init__(self, store: Store, *, worker: str = SWEEPER,
                 batch_limit: int = SWEEP_BATCH_LIMIT) -> None:
        self.store = store
        self.worker = worker
        self.batch_limit = batch_limit

    def run_once(self) -> Swept:
        """One sweep; returns how many parents became ready."""
        return self.store.hygiene.sweep(worker=self.worker, limit=self.batch_limit)


class Maintenance:
    """Reaper, watchdog and sweeper in one pass, run by one worker per interval.

    ``max_delivery`` is ``[retry] max_delivery`` and ``interval_seconds`` the worker's
    ``[worker] maintenance_interval_seconds`` (0: a pass whenever asked, for tests).
    """

    def __init__(self, store: Store, max_delivery: int, interval_seconds: float) -> None:
        if max_delivery < 1 or interval_seconds < 0:
            raise ValueError("max_delivery must be at least 1 and interval_seconds not negative")
        self.store = store
        self.max_delivery = max_delivery
        self.interval_seconds = interval_seconds

    def run_once(self) -> Maintained | None:
        """One pass if no other worker ran one within the interval; None when skipped."""
        return self.store.hygiene.maintain(self.max_delivery, self.interval_seconds,
                                           reap_limit=REAP_BATCH_LIMIT,
                                           timeout_limit=WATCHDOG_BATCH_LIMIT,
                                           sweep_limit=SWEEP_BATCH_LIMIT)
