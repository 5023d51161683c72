"""Batched model-call charges: what arrives within a few milliseconds is one statement.

A thousand tasks in flight make a thousand charges a second; one transaction each means
a thousand commits (and WAL flushes) a second, queued on a connection pool. The
:class:`ChargeWriter` collects the charges queued while its last batch was being written
(and those that arrive within :data:`CHARGE_WINDOW_SECONDS`) and writes them with one
``store.spend.charge_many`` (each call
still guarded by its task's lease token; a call whose lease is gone is not recorded and
its caller gets False, exactly as from ``store.spend.charge``).

Lanes: :data:`CHARGE_LANES` threads write batches side by side, each task's charges always
in the same lane (by its id). A reply is durable only once its batch committed, and a
commit waits for the disk: with one lane, a burst of replies waited for the batch in
flight, then for its own (measured on a loaded 2-core machine: 25 to 55 ms a batch, so
answers sat 50 to 100 ms before they were durable). Lanes overlap the batches; the
database serialises what they share (a tree's fair-time clock row, locked by every
charge of the tree) and flushes their commits together. No two lanes lock one task row
(a task's charges share a lane), so they cannot deadlock on tasks; a batch the database
aborts as a deadlock anyway (a cancelled task's late charge rolled up into an ancestor
another lane rolls up too) is written again.

Callers: :meth:`ChargeWriter.charge` blocks the calling thread until its batch is written
(a sync ``ctx.llm.complete`` in an agent thread); :meth:`ChargeWriter.enqueue` queues a
charge at once, from any thread, and returns a future of the outcome on a given event
loop (the model layer records a reply the moment it arrives, on the thread that read it,
then goes on: an answer is durable on arrival, SPEC section 15); :meth:`ChargeWriter.acharge`
awaits such a future. A batch's results reach each loop with one wake-up
(:class:`~runtime.engine.threads.LoopHandoff`), not one per charge. All say what
``store.spend.charge`` returns. Each charge is budget rule 5 (:mod:`runtime.budget`): a call
is charged to its own task only, its cost from :func:`runtime.budget.call_cost`.

Failure modes: while the database fails over (a broken connection, a read-only or
shutting-down server: :func:`runtime.store.postgres.failover.is_failover_error`), a batch is
written again with backoff for up to :data:`FAILOVER_RETRY_SECONDS`, so replies already
paid for are not lost to the outage. When the failed attempt was an in-doubt COMMIT, the
writer first asks which calls of the batch are recorded and charges only the others
(never twice). Any other database error, or an outage that outlasts the retries, fails
every charge of its batch with that error (the caller's model call then fails as
``store.spend.charge`` would have); the writer thread goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future

from runtime.engine.threads import handoff_for
from runtime.store.postgres import failover, retry
from runtime.store.rows import ModelCharge
from runtime.store.store import Store

log = logging.getLogger(__name__)

#: How long the writer waits for more charges after the first one of a batch. None: a
#: batch is what was queued when its lane got to it (what arrives while a batch is in
#: flight is the next one), so a lone reply is durable one commit after it arrived.
CHARGE_WINDOW_SECONDS = 0.0
#: The most charges written by one statement.
CHARGE_BATCH_LIMIT = 500
#: How long a batch is retried while the database fails over.
FAILOVER_RETRY_SECONDS = 60.0
#: Writer threads (lanes) whose batches may be in flight at once.
CHARGE_LANES = 4
#: SQLSTATEs of a transaction the database aborted to break a cycle: write it again.
_RETRY_STATES = frozenset({"40P01", "40001"})


class _LoopWaiter:
    """A coroutine's wait for its charge: settled through its loop's handoff."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[bool]) -> None:
        self.future = future

    def set_result(self, ok: bool) -> None:
        handoff_for(self.future.get_loop()).settle(self.future, ok)

    def set_exception(self, error: BaseException) -> None:
        handoff_for(self.future.get_loop()).settle(self.future, error=error)


#: What waits for a charge: a thread's future, or a coroutine's.
_Waiter = Future[bool] | _LoopWaiter


_Queue = queue.SimpleQueue[tuple[ModelCharge, _Waiter] | None]


class ChargeWriter:
    """Threads (lanes) that write model-call charges in batches (see the module doc)."""

    def __init__(self, store: Store, window_seconds: float = CHARGE_WINDOW_SECONDS,
                 batch_limit: int = CHARGE_BATCH_LIMIT, lanes: int = CHARGE_LANES) -> None:
        if lanes < 1:
            raise ValueError(f"a charge writer needs at least one lane (got {lanes})")
        self.store = store
        self.window_seconds = window_seconds
        self.batch_limit = batch_limit
        self.batches = 0
        self.charges = 0
        #: Charges found recorded after an in-doubt COMMIT (not written again).
        self.resolved_in_doubt = 0
        self._counts = threading.Lock()
        self._queues: list[_Queue] = [queue.SimpleQueue() for _ in range(lanes)]
        self._threads = [threading.Thread(target=self._run, args=(q,), daemon=True,
                                          name=f"charges-{n}")
                         for n, q in enumerate(self._queues)]
        for thread in self._threads:
            thread.start()

    def _lane(self, charge: ModelCharge) -> _Queue:
        """The queue of ``charge``'s task (the same for all of its charges)."""
        return self._queues[charge.task_id.int % len(self._queues)]

    def submit(self, charge: ModelCharge) -> Future[bool]:
        """Queue one charge; the future holds True (recorded) or False (lease gone)."""
        future: Future[bool] = Future()
        self._lane(charge).put((charge, future))
        return future

    def charge(self, charge: ModelCharge) -> bool:
        """Charge one call and wait for its batch to be written (from any thread)."""
        return self.submit(charge).result()

    def enqueue(self, charge: ModelCharge,
                loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future[bool]:
        """Queue one charge now; return the future of its outcome on ``loop``.

        ``loop`` defaults to the running one; from another thread, pass the loop whose
        coroutine will await the future (its result is set there, never here). The
        charge is in the writer's queue when this returns.
        """
        future: asyncio.Future[bool] = asyncio.Future(
            loop=loop if loop is not None else asyncio.get_running_loop())
        self._lane(charge).put((charge, _LoopWaiter(future)))
        return future

    async def acharge(self, charge: ModelCharge) -> bool:
        """Charge one call and await its batch (from a coroutine)."""
        return await self.enqueue(charge)

    def close(self) -> None:
        """Write what is queued, then stop the threads."""
        for lane in self._queues:
            lane.put(None)
        for thread in self._threads:
            thread.join()

    def _run(self, lane: _Queue) -> None:
        while True:
            first = lane.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.window_seconds
            closing = False
            while len(batch) < self.batch_limit:
                left = deadline - time.monotonic()
                try:
                    item = lane.get(timeout=left) if left > 0 else lane.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                batch.append(item)
            self._write(batch)
            if closing:
                return

    def _write(self, batch: list[tuple[ModelCharge, _Waiter]]) -> None:
        try:
            done = self._charge_through_failover([c for c, _ in batch])
        except Exception as exc:  # the callers see the error their own charge would raise
            log.warning("a batch of charges failed", extra={"size": len(batch),
                                                            "error": str(exc)})
            for _, future in batch:
                future.set_exception(exc)
            return
        with self._counts:
            self.batches += 1
            self.charges += len(batch)
        for (_, future), ok in zip(batch, done, strict=True):
            future.set_result(ok)

    def _charge_through_failover(self, charges: list[ModelCharge]) -> list[bool]:
        """``store.spend.charge_many``, retried while the database fails over, never twice."""
        done: dict[int, bool] = {}
        todo = list(range(len(charges)))
        doubt = False

        def attempt() -> list[bool]:
            nonlocal todo, doubt
            if doubt:  # the last COMMIT may have landed: what is recorded stays so
                recorded = self.store.spend.recorded([charges[i] for i in todo])
                done.update({todo[n]: True for n in recorded})
                todo = [i for n, i in enumerate(todo) if n not in recorded]
                with self._counts:
                    self.resolved_in_doubt += len(recorded)
                doubt = False
            written = self.store.spend.charge_many([charges[i] for i in todo]) if todo else []
            done.update(zip(todo, written, strict=True))
            return [done[i] for i in range(len(charges))]

        def in_doubt(exc: BaseException) -> None:
            nonlocal doubt
            doubt = doubt or failover.in_doubt(exc)

        return retry.retry(attempt, FAILOVER_RETRY_SECONDS, in_doubt, states=_RETRY_STATES)
