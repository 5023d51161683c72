"""What a worker holds, and how its parts signal each other (safe from any thread).

- :class:`InFlight`: one held task (claimed, its outcome not yet written): its row, its
  stage, its lease flag (a :class:`LeaseFlag`), the coroutine that works on it, and
  (once done) its action. :meth:`InFlight.abort` stops that work from any thread.
- :class:`Held`: the tasks held; the claim loop adds, the writer removes, the heartbeat
  reads.
- :class:`Wake`: wakes the claim loop (a notification, room freed, a stop).
- :class:`DbHealth`: counts database errors and logs one line per streak per place.
- :class:`Pace`: how many tasks the worker finished in the last second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.core.dberrors import one_line
from runtime.engine.actions import Action
from runtime.engine.worker.settings import WorkerStats
from runtime.store.postgres import failover
from runtime.store.rows import TaskRow

log = logging.getLogger(__name__)


#: Guards every :class:`LeaseFlag`'s state (held for a few instructions, never while waiting).
_FLAGS = threading.Lock()


class LeaseFlag(threading.Event):
    """A ``threading.Event`` whose condition and lock are made on its first ``wait``.

    A worker makes one per claimed task, hundreds per claim. ``threading.Event()`` builds a
    ``Condition`` and its lock each time: 3.7 us, 7 % of the database threads' Python in a
    no-op drain (py-spy). Almost no flag is ever waited on; ``is_set`` reads an attribute.
    """

    def __init__(self) -> None:  # not Event.__init__: the condition is made on demand
        self._flag = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        """True once set (and not cleared)."""
        return self._flag

    def set(self) -> None:
        """Set the flag and wake whoever waits on it."""
        with _FLAGS:
            self._flag = True
            if self._event is not None:
                self._event.set()

    def clear(self) -> None:
        """Reset the flag."""
        with _FLAGS:
            self._flag = False
            if self._event is not None:
                self._event.clear()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set or ``timeout`` seconds pass; return whether it is set."""
        with _FLAGS:
            if self._flag:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


@dataclass(eq=False)
class InFlight:
    """One held task: its row, its stage, its lease flag, its work, and (once done) its action.

    Attributes:
        row: the claimed row (its ``lease_token`` fences every write).
        kind: ``run`` or ``judge``.
        lease_lost: set when the task was taken away; the agent sees it as
            ``ctx.lease_lost`` and its model calls raise ``LeaseLost``.
        action: what the writer will write, once the work is done.
        job: the asyncio task working on it, or the future of its thread (a sync agent,
            the judge); None when stepped by hand, or not started.
        abort_reason: why :meth:`abort` stopped it, if it did.

    """

    row: TaskRow
    kind: str  # "run" or "judge"
    lease_lost: threading.Event = field(default_factory=LeaseFlag)
    action: Action | None = None
    job: asyncio.Future[Any] | None = None
    abort_reason: str | None = None

    @property
    def token(self) -> uuid.UUID | None:
        """The lease token of this claim."""
        return self.row.lease_token

    def abort(self, reason: str) -> None:
        """Stop the work on this task, from any thread: nothing of it will be written.

        The lease flag is set (a sync agent sees it, its model calls stop) and the task's
        coroutine is cancelled on its loop; the scheduler then ends it as ``Dropped`` with
        ``reason``. A sync agent's thread cannot be interrupted: it runs to its end and its
        result is ignored.
        """
        if self.abort_reason is None:
            self.abort_reason = reason
        self.lease_lost.set()
        job = self.job
        if job is not None and not job.done():
            with contextlib.suppress(RuntimeError):  # the loop already closed
                job.get_loop().call_soon_threadsafe(job.cancel)


class Held:
    """The tasks a worker holds (claimed, outcome not yet written); safe from any thread."""

    def __init__(self) -> None:
        self._items: dict[int, InFlight] = {}
        self._lock = threading.Lock()

    def add(self, item: InFlight) -> None:
        """Hold ``item`` until :meth:`remove`."""
        with self._lock:
            self._items[id(item)] = item

    def remove(self, items: list[InFlight]) -> None:
        """Stop holding ``items`` (their outcomes are written)."""
        with self._lock:
            for item in items:
                self._items.pop(id(item), None)

    def items(self) -> list[InFlight]:
        """A snapshot of what is held."""
        with self._lock:
            return list(self._items.values())

    def take(self, task_ids: set[Any]) -> list[InFlight]:
        """The held items of the tasks ``task_ids`` names, no longer held."""
        if not task_ids:
            return []
        with self._lock:
            items = [i for i in self._items.values() if i.row.id in task_ids]
            for item in items:
                del self._items[id(item)]
        return items

    def take_all(self) -> list[InFlight]:
        """Everything held, no longer held (a worker stopping hands them back)."""
        with self._lock:
            items = list(self._items.values())
            self._items.clear()
        return items

    def __contains__(self, item: object) -> bool:
        with self._lock:
            return id(item) in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


class Wake:
    """Wakes the claim loop from any thread; the loop sleeps on it between claims."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._announced = False  # new work announced since the claim loop last looked

    def bind(self, loop: asyncio.AbstractEventLoop, woken: bool = False) -> None:
        """Start waking ``loop`` (call on it); ``woken``: the first sleep returns at once."""
        self._event = asyncio.Event()
        if woken:
            self._event.set()
        self._loop = loop

    def unbind(self) -> None:
        """The loop is ending: wake-ups are dropped from now on."""
        self._loop = None

    def __call__(self) -> None:
        """Wake the loop (from any thread)."""
        loop, event = self._loop, self._event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(event.set)

    def announce(self) -> None:
        """New work was announced (a notification): wake the loop, and say so."""
        self._announced = True
        self()

    def take_announced(self) -> bool:
        """Whether new work was announced since the last call (and forget it)."""
        announced, self._announced = self._announced, False
        return announced

    async def sleep(self, seconds: float) -> bool:
        """Wait for a wake-up or ``seconds``; True when woken."""
        assert self._event is not None
        try:
            await asyncio.wait_for(self._event.wait(), seconds)
            woken = True
        except TimeoutError:
            woken = False
        self._event.clear()
        return woken


class DbHealth:
    """Counts database errors; logs one line per streak of failures in one place."""

    def __init__(self, stats: WorkerStats) -> None:
        self._stats = stats
        self._failing: set[str] = set()

    def error(self, where: str, exc: BaseException) -> None:
        """Count a database error in ``where``; log it when a streak starts.

        A failover error (the server gone, restarting or read-only) is the process's
        outage, logged once for every place at once
        (:data:`runtime.store.postgres.failover.OUTAGE`); each place's streak is then
        logged at DEBUG only.
        """
        self._stats.db_errors += 1
        if where not in self._failing:
            self._failing.add(where)
            line = f"{type(exc).__name__}: {one_line(exc, 300)}"
            if failover.is_failover_error(exc):
                failover.OUTAGE.begin(exc)
                log.debug(f"the worker's {where} waits for the database: {line}")
            else:
                log.warning(f"database error in the worker's {where}; retrying: {line}")

    def ok(self, where: str) -> None:
        """``where`` reached the database: end its streak, saying so."""
        if where in self._failing:
            self._failing.discard(where)
            log.debug(f"the worker's {where} reaches the database again")


class Pace:
    """Tasks finished over the last :attr:`window` seconds (the writer notes, the claim reads).

    Args:
        window: how far back the count goes, in seconds.
        clock: the time in seconds (``time.monotonic``; a test passes its own).

    """

    def __init__(self, window: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._clock = clock
        self._ended: deque[tuple[float, int]] = deque()
        self._total = 0

    def note(self, n: int) -> None:
        """``n`` tasks ended now."""
        self._ended.append((self._clock(), n))
        self._total += n
        self._forget()

    def per_second(self) -> float:
        """Tasks ended per second over the window."""
        self._forget()
        return self._total / self.window

    def _forget(self) -> None:
        horizon = self._clock() - self.window
        while self._ended and self._ended[0][0] < horizon:
            self._total -= self._ended.popleft()[1]
