"""A model call's text as it streams: the backends' hook, and one request's buffer.

Streaming (issue 47, ``[streaming]``): a backend that reads a reply in pieces (Ollama's
NDJSON lines, the embedded model's tokens, the offline and replay backends' words) calls
:func:`text_arrived` with each piece the moment it has it, on whatever thread read it.
The send stage (:class:`runtime.llm.sending.Sender`) sets :data:`ON_TEXT` around each
request to the request's :class:`TextStream`, which buffers the pieces; the text writer
(:class:`runtime.engine.text_writer.TextWriter`) takes what a stream has buffered at most
every ``flush_seconds`` (at once when ``flush_chars`` are waiting, or the reply is
complete) and writes it as one ``call_text`` row of the call's attempt at its offset.
A backend that does not stream (no hook called) writes nothing here: its reply is the
``model_calls`` row, as before.

The hook returns at once (a list append under a lock, a queue put when the stream
becomes dirty): it never waits for the database, so a backend's read loop is not slowed.

Continuing (:data:`CONTINUE_FROM`): a call whose last attempt was cut off by its
worker's death (text recorded, no reply ever arrived) is continued on its next delivery
by a backend that can continue a prefix (``continues_prefix``: the embedded model): the
send stage reads the recorded text, the stream goes on with the same attempt from its
end (:meth:`TextStream.resume`), and the backend generates only what comes after it.

Attempts: every other request (the call's first, a retry, a repair; on any delivery) is
a new stream and, when it has text, a new attempt of its call (``1, 2, ...`` per task, phase and
call index). The writer learns a stream's attempt from the database on its first write
(the call's highest attempt + 1, under the lease fence); :class:`CallAttempts` carries
the last one a delivery got, so a write retried after an in-doubt COMMIT finds its row
instead of taking a new attempt.
"""

from __future__ import annotations

import contextvars
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

#: Set by the send stage around one request: takes the request's text as it arrives.
ON_TEXT: contextvars.ContextVar[Callable[[str], None] | None] = \
    contextvars.ContextVar("orgchart_on_text", default=None)
#: Set by the send stage around a request that continues a call cut off mid-generation:
#: the text recorded before the cut (a backend that ``continues_prefix`` generates the
#: rest of the reply after it, and its reply's text starts with it).
CONTINUE_FROM: contextvars.ContextVar[str | None] = \
    contextvars.ContextVar("orgchart_continue_from", default=None)


def continued_text() -> str | None:
    """The recorded text the current request continues (None: a fresh generation)."""
    return CONTINUE_FROM.get()


def text_arrived(piece: str) -> None:
    """Say that the current request's reply went on with ``piece`` (any thread)."""
    hook = ON_TEXT.get()
    if hook is not None and piece:
        hook(piece)


#: Words and the spaces after them: how a backend that has its whole reply at once
#: (offline, replay) streams it, so readers see the shape a model server's reply has.
_WORDS = re.compile(r"\s*\S+\s*|\s+")


def text_in_pieces(text: str) -> None:
    """Stream ``text`` word by word to the current request's hook (none: nothing)."""
    hook = ON_TEXT.get()
    if hook is not None and text:
        for piece in _WORDS.findall(text):
            hook(piece)


def text_hook() -> Callable[[str], None] | None:
    """The current request's hook, for a backend that reads its reply on another thread."""
    return ON_TEXT.get()


@dataclass
class CallAttempts:
    """The highest attempt a delivery's streams of one call got so far (0: none yet)."""

    last: int = 0


class TextStream:
    """One request's text: pieces buffered as they arrive, taken by the writer in order.

    ``offset`` is where the buffered text starts in the request's output (characters,
    as Python and PostgreSQL count them: code points). ``attempt`` is None until the
    writer's first write gives it one. The stream is *complete* once it has ended, and
    nothing is buffered or being written (or it was refused): :meth:`wait` says so.
    """

    __slots__ = ("_chars", "_in_flight", "_lock", "_pending", "_waiter", "_wake", "attempt",
                 "attempts", "call_index", "ended", "flush_chars", "lease_token", "offset",
                 "phase", "queued", "refused", "seen", "task_id", "written")

    def __init__(self, task_id: uuid.UUID, lease_token: uuid.UUID, phase: str,
                 call_index: int, attempts: CallAttempts, flush_chars: int,
                 wake: Callable[[TextStream, bool], None]) -> None:
        self.task_id, self.lease_token, self.phase = task_id, lease_token, phase
        self.call_index, self.attempts, self.flush_chars = call_index, attempts, flush_chars
        self._wake = wake
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._chars = 0
        self._in_flight = False
        self._waiter: Callable[[bool], None] | None = None
        self.offset = 0
        self.attempt: int | None = None
        #: In the writer's queue (it will take the buffer).
        self.queued = False
        #: The request is over (no more pieces); the writer writes the rest at once.
        self.ended = False
        #: The lease was gone at a write, or a write failed: nothing more is written.
        self.refused = False
        #: Characters written so far.
        self.written = 0
        #: Whether any text arrived.
        self.seen = False

    def add(self, piece: str) -> None:
        """Buffer ``piece``; wake the writer when the stream was clean or is full."""
        if not piece or self.refused:
            return
        if "\x00" in piece:  # PostgreSQL's text refuses NUL: one character for one
            piece = piece.replace("\x00", "\ufffd")
        with self._lock:
            if self.ended:
                return
            self._pending.append(piece)
            self._chars += len(piece)
            # The call's first text is written at once (a reader sees the call start);
            # full: wake once, as the buffer crosses the mark (not at every piece after).
            now = not self.seen or self._chars >= self.flush_chars > self._chars - len(piece)
            self.seen = True
            first = not self.queued
            self.queued = True
        if first or now:
            self._wake(self, now)

    def end(self) -> None:
        """The request is over: what is buffered is written at once (idempotent)."""
        with self._lock:
            if self.ended:
                return
            self.ended = True
            wake = bool(self._pending) and not self.refused
            if wake:
                self.queued = True
        if wake:
            self._wake(self, True)

    def wait(self, waiter: Callable[[bool], None]) -> bool:
        """True when complete now; else ``waiter(ok)`` is called (by the writer) once it is."""
        with self._lock:
            if self._complete():
                return True
            self._waiter = waiter
            return False

    def _complete(self) -> bool:
        return self.refused or (self.ended and not self._pending and not self._in_flight)

    def take(self) -> tuple[int, str] | None:
        """The buffered text and its offset (the writer's), or None when nothing is buffered."""
        with self._lock:
            self.queued = False
            if not self._pending or self.refused:
                return None
            text = "".join(self._pending)
            self._pending.clear()
            self._chars = 0
            offset = self.offset
            self.offset += len(text)
            self._in_flight = True
            return offset, text

    def wrote(self, chars: int) -> None:
        """The writer wrote the text it took (``chars`` characters)."""
        with self._lock:
            self.written += chars
            self._in_flight = False
        self._settle()

    def give_back(self, offset: int, text: str) -> None:
        """Put the text the writer took and could not write back in front of the buffer."""
        with self._lock:
            self._pending.insert(0, text)
            self._chars += len(text)
            self.offset = offset
            self._in_flight = False
            self.queued = True

    def resume(self, attempt: int, offset: int) -> None:
        """Continue ``attempt`` of the call from ``offset`` (its recorded text's length)."""
        with self._lock:
            self.attempt = attempt
            self.offset = offset
            self.written = offset
        self.attempts.last = max(self.attempts.last, attempt)

    def has_pending(self) -> bool:
        """Whether text is buffered."""
        with self._lock:
            return bool(self._pending)

    def refuse(self) -> None:
        """Write nothing more (the lease is gone, or a write failed); drop what is buffered."""
        with self._lock:
            self.refused = True
            self._pending.clear()
            self._chars = 0
            self._in_flight = False
        self._settle()

    def settle_if_complete(self) -> None:
        """Call the waiter when the stream is complete (the writer, after a batch)."""
        self._settle()

    def _settle(self) -> None:
        with self._lock:
            waiter = self._waiter if self._complete() else None
            if waiter is not None:
                self._waiter = None
        if waiter is not None:
            waiter(not self.refused)


class TextSink(Protocol):
    """Where requests' streams are written (:class:`runtime.engine.text_writer.TextWriter`)."""

    def open(self, task_id: uuid.UUID, lease_token: uuid.UUID, phase: str,
             call_index: int, attempts: CallAttempts) -> TextStream:
        """A new stream for one request of a call."""
        ...

    async def finished(self, stream: TextStream) -> bool:
        """End ``stream`` and await the write of its last piece; False: refused or failed."""
        ...

    def cut_off(self, task_id: uuid.UUID, phase: str, call_index: int) -> tuple[int, str] | None:
        """``(attempt, text)`` of the call when it was cut off mid-generation, else None."""
        ...
