"""Streamed text, group-committed: the pieces of many calls in one statement per batch.

Each request of a model call streams into a :class:`~runtime.llm.text_stream.TextStream`
(the backends' pieces, buffered). The :class:`TextWriter`'s threads (lanes; a task's
streams always in the same lane, as the charge writer's) take what the dirty streams have
buffered and write it with one ``call_text_write_many`` (:meth:`runtime.store.call_text.
CallText.write`): one row per stream per batch, fenced by the task's lease token.

When: a batch is written ``flush_seconds`` after the first stream of it became dirty, or
at once when a stream has ``flush_chars`` buffered or its request ended (its reply is
complete); what is queued meanwhile joins it. So a piece reaches the database at most
``flush_seconds`` (plus a commit) after it arrived, and a call writes at most one row per
batch.

Attempts: a stream's first write carries no attempt; the statement gives it the call's
next (max + 1), or the delivery's own row when an earlier try of the same write committed
(an in-doubt COMMIT). Two new streams of one call never share a batch (the second waits
for the next), so each gets its own. A first write that finds another delivery's row at
its key (a worker whose lease was taken away wrote it at the same moment) is given its
text back and asks for the next attempt in the next batch.

Failure modes: while the database fails over, a batch is written again with backoff for
up to :data:`FAILOVER_RETRY_SECONDS` (the statement is idempotent: see above). Any other
error drops the batch's streams (nothing more is written for them; their calls go on:
the reply is the ``model_calls`` row) and is logged. A stream whose lease is gone is
refused and writes nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid

from runtime.engine.threads import handoff_for
from runtime.llm.text_stream import CallAttempts, TextSink, TextStream
from runtime.store.call_text import PieceOutcome, TextPiece
from runtime.store.postgres import retry
from runtime.store.store import Store

log = logging.getLogger(__name__)

#: Writer threads whose batches may be in flight at once.
TEXT_LANES = 2
#: The most streams written by one statement.
TEXT_BATCH_LIMIT = 1000
#: How long a batch is retried while the database fails over.
FAILOVER_RETRY_SECONDS = 60.0
#: SQLSTATEs to write a batch again at once: a transaction the database aborted to break
#: a cycle, and a unique violation (another delivery's piece at one of the batch's keys,
#: committed while this batch was written: the statement skips it the next time).
_RETRY_STATES = frozenset({"40P01", "40001", "23505"})

_Item = tuple[TextStream, bool] | None
_Lane = queue.SimpleQueue[_Item]


class TextWriter(TextSink):
    """Threads (lanes) that write streamed text in batches (see the module doc).

    Args:
        store: the database.
        flush_seconds: the longest a piece waits before its batch is written.
        flush_chars: a stream with this many characters buffered is written at once.
        lanes / batch_limit: writer threads, and the most streams in one statement.

    """

    def __init__(self, store: Store, flush_seconds: float = 0.1, flush_chars: int = 256,
                 lanes: int = TEXT_LANES, batch_limit: int = TEXT_BATCH_LIMIT) -> None:
        if lanes < 1:
            raise ValueError(f"a text writer needs at least one lane (got {lanes})")
        self.store = store
        self.flush_seconds = flush_seconds
        self.flush_chars = flush_chars
        self.batch_limit = batch_limit
        #: Batches and rows written, characters written (for benches and tests).
        self.batches = 0
        self.rows = 0
        self.chars = 0
        self._counts = threading.Lock()
        self._lanes: list[_Lane] = [queue.SimpleQueue() for _ in range(lanes)]
        self._threads = [threading.Thread(target=self._run, args=(lane,), daemon=True,
                                          name=f"call-text-{n}")
                         for n, lane in enumerate(self._lanes)]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ the model layer's
    def open(self, task_id: uuid.UUID, lease_token: uuid.UUID, phase: str,
             call_index: int, attempts: CallAttempts) -> TextStream:
        """A new stream for one request of a call (written by this writer)."""
        return TextStream(task_id, lease_token, phase, call_index, attempts,
                          self.flush_chars, self._wake)

    async def finished(self, stream: TextStream) -> bool:
        """End ``stream`` and await the write of its last piece; False: refused or failed."""
        stream.end()
        if not stream.seen:
            return True
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        handoff = handoff_for(loop)
        if stream.wait(lambda ok: handoff.settle(future, ok)):
            return not stream.refused
        return await future

    def cut_off(self, task_id: uuid.UUID, phase: str, call_index: int) -> tuple[int, str] | None:
        """``(attempt, text)`` of the call when it was cut off mid-generation (blocking read)."""
        return self.store.call_text.cut_off(task_id, phase, call_index)

    def close(self) -> None:
        """Write what is queued, then stop the threads."""
        for lane in self._lanes:
            lane.put(None)
        for thread in self._threads:
            thread.join()

    # ------------------------------------------------------------------ the threads
    def _wake(self, stream: TextStream, now: bool) -> None:
        self._lanes[stream.task_id.int % len(self._lanes)].put((stream, now))

    def _run(self, lane: _Lane) -> None:
        carry: list[TextStream] = []
        stopping = False
        while True:
            dirty: dict[int, TextStream] = {id(s): s for s in carry}
            urgent = bool(carry)
            carry = []
            if not dirty:
                first = lane.get()
                if first is None:
                    return
                dirty[id(first[0])] = first[0]
                urgent = first[1]
            deadline = time.monotonic() + self.flush_seconds
            while len(dirty) < self.batch_limit:
                left = 0.0 if urgent else deadline - time.monotonic()
                try:
                    item = lane.get(timeout=left) if left > 0 else lane.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                dirty.setdefault(id(item[0]), item[0])
                urgent = urgent or item[1]
            carry = self._write_batch(list(dirty.values()))
            if stopping and not carry:
                return

    def _write_batch(self, streams: list[TextStream]) -> list[TextStream]:
        """Write one piece per stream; return the streams to write again at once."""
        carry: list[TextStream] = []
        new_calls: set[tuple[uuid.UUID, str, int]] = set()
        pieces: list[TextPiece] = []
        taken: list[tuple[TextStream, int, str]] = []
        for stream in streams:
            if stream.attempt is None:
                call = (stream.task_id, stream.phase, stream.call_index)
                if call in new_calls:  # its attempt must follow the first one's
                    carry.append(stream)
                    continue
            piece = stream.take()
            if piece is None:
                stream.settle_if_complete()
                continue
            if stream.attempt is None:
                new_calls.add((stream.task_id, stream.phase, stream.call_index))
            offset, text = piece
            pieces.append(TextPiece(stream.task_id, stream.lease_token, stream.phase,
                                    stream.call_index, stream.attempt, stream.attempts.last,
                                    offset, text))
            taken.append((stream, offset, text))
        if not pieces:
            return carry
        try:
            outcomes = self._through_failover(pieces)
        except Exception as exc:
            log.warning("a batch of streamed text failed; its calls stream no more",
                        extra={"size": len(pieces), "error": str(exc)})
            for stream, _, _ in taken:
                stream.refuse()
            return carry
        chars = 0
        for (stream, offset, text), outcome in zip(taken, outcomes, strict=True):
            if not outcome.fenced:
                stream.refuse()  # the lease is gone: nothing more of this delivery
            elif stream.attempt is None and not outcome.ours:
                stream.give_back(offset, text)  # another delivery's row: the next attempt
                carry.append(stream)
            else:
                if stream.attempt is None and outcome.attempt is not None:
                    stream.attempt = outcome.attempt
                    stream.attempts.last = max(stream.attempts.last, outcome.attempt)
                chars += len(text)
                stream.wrote(len(text))
                if stream.has_pending() and stream.ended:
                    carry.append(stream)
        with self._counts:
            self.batches += 1
            self.rows += len(pieces)
            self.chars += chars
        return carry

    def _through_failover(self, pieces: list[TextPiece]) -> list[PieceOutcome]:
        """``store.call_text.write``, again while the database fails over (idempotent)."""
        return retry.retry(lambda: self.store.call_text.write(pieces),
                           FAILOVER_RETRY_SECONDS, states=_RETRY_STATES)
