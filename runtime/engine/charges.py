"""Batched model-call charges: what arrives within a few milliseconds is one statement.

A thousand tasks in flight make a thousand charges a second; one transaction each means
a thousand commits (and WAL flushes) a second, queued on a connection pool. The
:class:`ChargeWriter` collects the charges that arrive within
:data:`CHARGE_WINDOW_SECONDS` and writes them with one ``Store.charge_many`` (each call
still guarded by its task's lease token; a call whose lease is gone is not recorded and
its caller gets False, exactly as from ``Store.charge``).

Callers: :meth:`ChargeWriter.charge` blocks the calling thread until its batch is written
(a sync ``ctx.llm.complete`` in an agent thread); :meth:`ChargeWriter.acharge` awaits it
(an ``async`` model call on the worker's loop: a batch's results reach the loop with one
wake-up, :class:`~runtime.engine.threads.LoopHandoff`, not one per charge). Both return
what ``Store.charge`` returns. Each charge is budget rule 5 (:mod:`runtime.budget`): a call
is charged to its own task only, its cost from :func:`runtime.budget.call_cost`.

Failure modes: while the database fails over (a broken connection, a read-only or
shutting-down server: :func:`runtime.store.postgres.failover.is_failover_error`), a batch is
written again with backoff for up to :data:`FAILOVER_RETRY_SECONDS`, so replies already
paid for are not lost to the outage. When the failed attempt was an in-doubt COMMIT, the
writer first asks which calls of the batch are recorded and charges only the others
(never twice). Any other database error, or an outage that outlasts the retries, fails
every charge of its batch with that error (the caller's model call then fails as
``Store.charge`` would have); the writer thread goes on.
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

#: How long the writer waits for more charges after the first one of a batch.
CHARGE_WINDOW_SECONDS = 0.002
#: The most charges written by one statement.
CHARGE_BATCH_LIMIT = 500
#: How long a batch is retried while the database fails over.
FAILOVER_RETRY_SECONDS = 60.0


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


class ChargeWriter:
    """One thread that writes model-call charges in batches (see the module doc)."""

    def __init__(self, store: Store, window_seconds: float = CHARGE_WINDOW_SECONDS,
                 batch_limit: int = CHARGE_BATCH_LIMIT) -> None:
        self.store = store
        self.window_seconds = window_seconds
        self.batch_limit = batch_limit
        self.batches = 0
        self.charges = 0
        #: Charges found recorded after an in-doubt COMMIT (not written again).
        self.resolved_in_doubt = 0
        self._queue: queue.SimpleQueue[tuple[ModelCharge, _Waiter] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="charges", daemon=True)
        self._thread.start()

    def submit(self, charge: ModelCharge) -> Future[bool]:
        """Queue one charge; the future holds True (recorded) or False (lease gone)."""
        future: Future[bool] = Future()
        self._queue.put((charge, future))
        return future

    def charge(self, charge: ModelCharge) -> bool:
        """Charge one call and wait for its batch to be written (from any thread)."""
        return self.submit(charge).result()

    async def acharge(self, charge: ModelCharge) -> bool:
        """Charge one call and await its batch (from a coroutine)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._queue.put((charge, _LoopWaiter(future)))
        return await future

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.window_seconds
            closing = False
            while len(batch) < self.batch_limit:
                left = deadline - time.monotonic()
                try:
                    item = self._queue.get(timeout=left) if left > 0 else \
                        self._queue.get_nowait()
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
        self.batches += 1
        self.charges += len(batch)
        for (_, future), ok in zip(batch, done, strict=True):
            future.set_result(ok)

    def _charge_through_failover(self, charges: list[ModelCharge]) -> list[bool]:
        """``Store.charge_many``, retried while the database fails over, never twice."""
        done: dict[int, bool] = {}
        todo = list(range(len(charges)))
        deadline = time.monotonic() + FAILOVER_RETRY_SECONDS
        delay = retry.backoff_delays()
        doubt = False
        while True:
            try:
                if doubt:  # the last COMMIT may have landed: what is recorded stays so
                    recorded = self.store.recorded_charges([charges[i] for i in todo])
                    done.update({todo[n]: True for n in recorded})
                    todo = [i for n, i in enumerate(todo) if n not in recorded]
                    self.resolved_in_doubt += len(recorded)
                    doubt = False
                written = self.store.charge_many([charges[i] for i in todo]) if todo else []
                done.update(zip(todo, written, strict=True))
                return [done[i] for i in range(len(charges))]
            except Exception as exc:
                if not failover.is_failover_error(exc) or time.monotonic() >= deadline:
                    raise
                doubt = doubt or failover.in_doubt(exc)
                time.sleep(delay())
