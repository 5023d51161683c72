"""The start gate of model calls: no call starts for a cancelled task or in a paused tree.

Every request passes :meth:`CallGate.send` once it holds its server slot, right before it
is sent:

1. a task the worker already knows to be stopped (:meth:`CallGate.stop`, fed by the
   worker's stop check: the heartbeat, the ``cancel`` notification and a poll) is
   refused at once with :class:`~runtime.errors.LeaseLost`;
2. otherwise the database is asked (the ledger's ``gate_calls``: the task's status and
   whether its tree is paused). The question is batched: the calls that arrive while one
   read is in flight share the next read, so a thousand calls in flight cost a read per
   wave, not one each. A read always starts after its call asked, so a call that starts
   after ``orgchart cancel`` returned sees the cancel: this is what makes "no call
   starts after the cancel command returned" hold without depending on a notification;
   A cancel or pause announced (``refresh``, on the worker's notification) while a read
   was in flight makes its callers read again: a read that began before the command
   committed could not see it;
3. a task that is no longer running (cancelled, or taken away) is refused; a task whose
   tree is paused gives its slot back and waits, asking again every
   :data:`PAUSE_POLL_SECONDS`, until the tree is resumed (a call already sent finishes
   and is recorded as usual).

:meth:`CallGate.stop` also cancels the requests in flight of the stopped tasks (the
coroutine awaiting the server is cancelled, so its connection is dropped), from any
thread. A ledger without ``gate_calls`` (a test's stand-in) leaves the gate open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from runtime.errors import LeaseLost

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How often a call held by a paused tree asks whether the tree was resumed.
PAUSE_POLL_SECONDS = 0.25
#: A gate read that fails is retried this many times, this far apart, before the call fails.
READ_TRIES = 20
READ_RETRY_SECONDS = 0.5
#: The database's answer for one task: (status or None when gone, tree paused).
GateState = tuple[str | None, bool]
#: Reads the gate's state of many tasks at once (blocking: run in the ledger's threads).
GateRead = Callable[[Sequence[uuid.UUID]], dict[uuid.UUID, GateState]]
#: Runs a blocking function off the loop (the model layer's ledger threads).
OffLoop = Callable[..., Awaitable[Any]]
_OPEN = ("running", "judging")
_Waiting = dict[uuid.UUID, list["asyncio.Future[GateState]"]]


class CallGate:
    """Decides, right before a request is sent, whether it may start (see the module doc).

    Args:
        read: the ledger's batched read (None: the gate is always open).
        off_loop: runs ``read`` off the event loop.

    """

    def __init__(self, read: GateRead | None, off_loop: OffLoop) -> None:
        self._read = read
        self._off_loop = off_loop
        self._stopped: set[uuid.UUID] = set()
        self._lock = threading.Lock()
        self._waiting: dict[asyncio.AbstractEventLoop, _Waiting] = {}
        self._reading: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}
        self._sending: dict[uuid.UUID, set[asyncio.Task[Any]]] = {}
        self._generation = 0

    # ------------------------------------------------------------------ stopping
    def stop(self, task_ids: Sequence[uuid.UUID]) -> int:
        """Refuse every later call of these tasks and cancel their requests in flight.

        Safe from any thread. Returns how many requests in flight were cancelled.
        """
        with self._lock:
            self._stopped.update(task_ids)
            jobs = [job for t in task_ids for job in self._sending.get(t, ())]
        for job in jobs:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                job.get_loop().call_soon_threadsafe(job.cancel)
        return len(jobs)

    def refresh(self) -> None:
        """A cancel or a pause was announced (from any thread): answers read before it are stale.

        Every call whose database read was in flight reads again before it is sent, so the
        window in which a call may start after a cancel or pause committed is the time the
        announcement takes to reach this process.
        """
        with self._lock:
            self._generation += 1

    def forget(self, task_ids: Sequence[uuid.UUID]) -> None:
        """Drop tasks from the stopped set (their work is over; keeps the set small)."""
        with self._lock:
            self._stopped.difference_update(task_ids)

    def is_stopped(self, task_id: uuid.UUID) -> bool:
        """True when the worker knows this task was stopped."""
        with self._lock:
            return task_id in self._stopped

    # ------------------------------------------------------------------ sending
    async def send(self, task_id: uuid.UUID, slot: AbstractAsyncContextManager[Any],
                   request: Callable[[], Awaitable[T]]) -> T:
        """Send ``request()`` under ``slot`` once the gate lets ``task_id`` call.

        Raises:
            LeaseLost: the task was cancelled or taken away; nothing was sent.

        """
        while True:
            async with slot:
                paused = await self._check(task_id)
                if not paused:
                    return await self._sending_as(task_id, request)
            await asyncio.sleep(PAUSE_POLL_SECONDS)  # the slot is free for other trees

    async def _sending_as(self, task_id: uuid.UUID, request: Callable[[], Awaitable[T]]) -> T:
        job = asyncio.current_task()
        assert job is not None
        with self._lock:
            if task_id in self._stopped:
                raise LeaseLost(f"task {task_id}: cancelled; the model was not called")
            self._sending.setdefault(task_id, set()).add(job)
        try:
            return await request()
        finally:
            with self._lock:
                jobs = self._sending.get(task_id)
                if jobs is not None:
                    jobs.discard(job)
                    if not jobs:
                        del self._sending[task_id]

    async def _check(self, task_id: uuid.UUID) -> bool:
        """True when the task's tree is paused; raises when the task may not call at all."""
        if self.is_stopped(task_id):
            raise LeaseLost(f"task {task_id}: cancelled; the model was not called")
        if self._read is None:
            return False
        attempt = 0
        while True:
            generation = self._generation
            try:
                status, paused = await self._ask(task_id)
            except Exception:  # the database is away: wait, never send unchecked
                attempt += 1
                if attempt >= READ_TRIES:
                    raise
                log.warning("model-call gate: the database did not answer; retrying",
                            exc_info=True)
                await asyncio.sleep(READ_RETRY_SECONDS)
                continue
            # A cancel or pause announced while the read was in flight may have committed
            # after the read's snapshot: ask again (a fresh read sees it).
            if generation == self._generation:
                break
        if status not in _OPEN:
            with self._lock:
                self._stopped.add(task_id)
            raise LeaseLost(f"task {task_id}: {status or 'gone'}; the model was not called")
        return paused

    async def _ask(self, task_id: uuid.UUID) -> GateState:
        """Join the next batched read for this loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GateState] = loop.create_future()
        self._waiting.setdefault(loop, {}).setdefault(task_id, []).append(future)
        if loop not in self._reading:
            self._reading[loop] = loop.create_task(self._read_batches(loop))
        return await future

    async def _read_batches(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the waiting tasks' state, batch after batch, until nobody waits."""
        assert self._read is not None
        try:
            while self._waiting.get(loop):
                batch = self._waiting.pop(loop)
                try:
                    states = await self._off_loop(self._read, list(batch))
                except Exception as exc:  # the callers see the database's error
                    for futures in batch.values():
                        for f in futures:
                            if not f.done():
                                f.set_exception(exc)
                    continue
                for task_id, futures in batch.items():
                    state = states.get(task_id, (None, False))
                    for f in futures:
                        if not f.done():
                            f.set_result(state)
        finally:
            self._reading.pop(loop, None)
