"""The start gate of model calls: no call starts for a cancelled task or in a paused tree.

Every request passes :meth:`CallGate.send` once it holds its server slot, right before it
is sent:

1. a task the worker already knows to be stopped (:meth:`CallGate.stop`, fed by the
   worker's stop check: the heartbeat, the ``cancel`` notification and a poll) is
   refused at once with :class:`~runtime.errors.LeaseLost`;
2. otherwise the database is asked (the ledger's ``gate_calls``: the task's status and
   whether its tree is paused). The question is batched: the calls that arrive while one
   read is in flight share the next read, so a thousand calls in flight cost a read per
   wave, not one each. A read always starts after its call asked, and it holds the
   trees' steering locks (shared) until the calls it let through have started: a cancel
   or a pause takes the lock exclusively before it writes, so it waits for those calls
   to be sent and the reads after it see it. "Sent" is said by the HTTP transport once a
   request's bytes are written (:func:`request_sent`; other backends: when the request
   ends), bounded by :data:`SENT_WAIT_SECONDS`. So no call starts after such a command
   committed;
   A cancel or pause announced (``refresh``, on the worker's notification) while a read
   was in flight makes its callers read again: a read that began before the command
   committed could not see it;
3. a task that is no longer running (cancelled, or taken away) is refused, and so is a
   caller whose lease token is no longer the task's (the reaper handed the task to
   another worker, as after a network partition healed: this worker's heartbeat may not
   have said so yet, the database says it before the call starts; a hand-over that
   commits between the read and the send is caught after, by the charge, whose write is
   fenced by the same token: the answer is dropped, never recorded); a task whose
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
import contextvars
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

from runtime.core.dberrors import one_line
from runtime.errors import LeaseLost

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How often a call held by a paused tree asks whether the tree was resumed.
PAUSE_POLL_SECONDS = 0.25
#: A gate read that fails is retried this many times, this far apart, before the call fails.
READ_TRIES = 20
READ_RETRY_SECONDS = 0.5
#: The longest a wave of reads holds its trees' steering locks waiting for its calls to
#: be sent (a caller that never says so: cancelled before it resumed, a stuck send).
SENT_WAIT_SECONDS = 5.0
#: The database's answer for one task: (status or None when gone, tree paused, the lease
#: token that holds it now or None).
GateState = tuple[str | None, bool, uuid.UUID | None]
#: Reads the gate's state of many tasks at once (blocking: run in the ledger's threads),
#: under the trees' steering locks; returns the states and the ``release`` of the locks.
GateRead = Callable[[Sequence[uuid.UUID]],
                    tuple[dict[uuid.UUID, GateState], Callable[[], None]]]
#: Runs a blocking function off the loop (the model layer's ledger threads).
OffLoop = Callable[..., Awaitable[Any]]
_OPEN = ("running", "judging")
_Waiting = dict[uuid.UUID, list["asyncio.Future[tuple[GateState, _Wave]]"]]

#: Set by the gate around a request it let through: the HTTP transport calls it once the
#: request's bytes are written (``runtime/llm/backends/transport.py``), so the wave that
#: let it through can release its trees' steering locks. Other backends never call it:
#: the request's end counts instead.
REQUEST_SENT: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "orgchart_request_sent", default=None)


def request_sent() -> None:
    """Say that the current request's bytes are on their way (called by the transport)."""
    hook = REQUEST_SENT.get()
    if hook is not None:
        hook()


class _Wave:
    """The callers one gate read answered; its locks are released when all have sent."""

    def __init__(self, callers: int, release: Callable[[], None]) -> None:
        self.pending = callers
        self.release = release
        self.all_sent = asyncio.Event()
        if callers <= 0:
            self.all_sent.set()

    def sent_by(self) -> Callable[[], None]:
        """A callback for one caller: the first call counts it as sent, later ones nothing."""
        done = False

        def sent() -> None:
            nonlocal done
            if not done:
                done = True
                self.pending -= 1
                if self.pending <= 0:
                    self.all_sent.set()

        return sent


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
        self._releasing: set[asyncio.Task[None]] = set()
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

        Every call whose database read was in flight reads again before it is sent.
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
                   request: Callable[[], Awaitable[T]],
                   lease_token: uuid.UUID | None = None) -> T:
        """Send ``request()`` under ``slot`` once the gate lets ``task_id`` call.

        ``lease_token`` is the caller's lease: when given, the call starts only while the
        task is still held by it.

        Raises:
            LeaseLost: the task was cancelled or taken away; nothing was sent.

        """
        while True:
            async with slot:
                paused, sent = await self._check(task_id, lease_token)
                try:
                    if not paused:
                        with self._in_flight(task_id, sent):
                            return await request()
                finally:
                    sent()  # sent, refused or waiting: the wave need not wait for this one
            await asyncio.sleep(PAUSE_POLL_SECONDS)  # the slot is free for other trees

    @contextlib.contextmanager
    def _in_flight(self, task_id: uuid.UUID, sent: Callable[[], None]) -> Iterator[None]:
        """The request of the running job as in flight for ``task_id`` (:meth:`stop`)."""
        job = asyncio.current_task()
        assert job is not None
        with self._lock:
            if task_id in self._stopped:
                raise LeaseLost(f"task {task_id}: cancelled; the model was not called")
            self._sending.setdefault(task_id, set()).add(job)
        token = REQUEST_SENT.set(sent)
        try:
            yield
        finally:
            REQUEST_SENT.reset(token)
            with self._lock:
                jobs = self._sending.get(task_id)
                if jobs is not None:
                    jobs.discard(job)
                    if not jobs:
                        del self._sending[task_id]

    async def _check(self, task_id: uuid.UUID, lease_token: uuid.UUID | None
                     ) -> tuple[bool, Callable[[], None]]:
        """Whether the task's tree is paused, and the caller's "sent" callback.

        Raises when the task may not call at all.
        """
        if self.is_stopped(task_id):
            raise LeaseLost(f"task {task_id}: cancelled; the model was not called")
        if self._read is None:
            return False, _nothing
        attempt = 0
        while True:
            generation = self._generation
            try:
                (status, paused, holder), wave = await self._ask(task_id)
            except Exception:  # the database is away: wait, never send unchecked
                attempt += 1
                if attempt >= READ_TRIES:
                    raise
                log.warning("model-call gate: the database did not answer; retrying",
                            exc_info=True)
                await asyncio.sleep(READ_RETRY_SECONDS)
                continue
            sent = wave.sent_by()
            # A cancel or pause announced while the read was in flight may have committed
            # after the read's snapshot: ask again (a fresh read sees it).
            if generation == self._generation:
                break
            sent()
        if status not in _OPEN:
            sent()
            with self._lock:
                self._stopped.add(task_id)
            raise LeaseLost(f"task {task_id}: {status or 'gone'}; the model was not called")
        if lease_token is not None and holder != lease_token:
            # Taken away from this caller only: the task's id is not stopped (this worker
            # may hold it again under a new lease).
            sent()
            raise LeaseLost(f"task {task_id}: its lease was taken away; the model was not "
                            "called")
        return paused, sent

    async def _ask(self, task_id: uuid.UUID) -> tuple[GateState, _Wave]:
        """Join the next batched read for this loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[GateState, _Wave]] = loop.create_future()
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
                    states, release = await self._off_loop(self._read, list(batch))
                except Exception as exc:  # the callers see the database's error
                    for futures in batch.values():
                        for f in futures:
                            if not f.done():
                                f.set_exception(exc)
                    continue
                wave = _Wave(sum(len(f) for f in batch.values()), release)
                for task_id, futures in batch.items():
                    state = states.get(task_id, (None, False, None))
                    for f in futures:
                        if f.done():
                            wave.sent_by()()  # its caller is gone
                        else:
                            f.set_result((state, wave))
                # The locks are held until this wave's calls are sent; the next read need
                # not wait for that.
                job = loop.create_task(self._release_when_sent(wave))
                self._releasing.add(job)
                job.add_done_callback(self._releasing.discard)
        finally:
            self._reading.pop(loop, None)

    async def _release_when_sent(self, wave: _Wave) -> None:
        """Release a wave's steering locks once its calls are sent (bounded wait)."""
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wave.all_sent.wait(), SENT_WAIT_SECONDS)
        finally:
            try:
                await self._off_loop(wave.release)
            except asyncio.CancelledError:
                wave.release()  # the loop is ending: never leave the locks held
                raise
            except Exception as exc:  # (a task of its own: nobody else would hear of it)
                log.warning("model-call gate: a wave's read could not be ended "
                            f"({one_line(exc)}); its locks end with its session")


def _nothing() -> None:
    """The "sent" callback when no read was made."""


@dataclass(frozen=True)
class TaskStop:
    """Why one task's calls may no longer start: its lease lost, or the gate stopped it.

    The :data:`~runtime.llm.token_meter.StopCheck` a call waiting for its tenant's
    tokens looks at between sleeps (:meth:`CallGate.is_stopped` for ``is_stopped``).
    """

    task_id: Any
    lease_lost: threading.Event
    is_stopped: Callable[[Any], bool]

    def __call__(self) -> str | None:
        """Why the task's call may no longer start, or None."""
        if self.lease_lost.is_set() or self.is_stopped(self.task_id):
            return f"task {self.task_id}: stopped while its call waited for its tenant's tokens"
        return None
