"""A tree's stream: its model calls' text as it grows and its tasks' transitions, gap-free.

A part of the store (``store.streams``, :class:`StreamReader`), and the cursors over it
(:class:`TreeStream`, :class:`Horizon`, :func:`follow`): what
``GET /trees/{root_id}/stream``, ``orgchart follow`` and the client's ``stream()`` read
(docs/api.md, "The stream"). Two tables feed it: ``call_text`` (the pieces of each
call's output, written by the model layer as they stream) and ``task_events`` (the
transitions). Both carry ``txid``, the writing transaction's id (migration 0017), and
the stream is both merged in ``(txid, source, id)`` order (pieces before transitions of
one transaction), read only below the snapshot's ``xmin``: every transaction below it
has finished, so no row can commit later before what was read, whatever the order
transactions commit in. A reader that was shown event ``X`` and comes back with ``X`` as
its cursor gets every later event once.

Event ids (:class:`Position`) say where in that order an event stands: ``<txid>.t<id>``
for the piece ``call_text.id``, ``<txid>.s<id>`` for the ``superseded`` notice just
before the first piece of a newer attempt, ``<txid>.e<id>`` for the transition
``task_events.id``; a transition older than migration 0017 (no txid) is ``0.e<id>``.

The stream ends after the root's terminal transition (the newest transition of the
root, when it is one of :data:`TERMINAL_STATUSES`) and every row its transaction and
the earlier ones wrote. An escalated root that is retried goes on: a reader that comes
back with its cursor reads on.

Failure modes: a malformed cursor raises :class:`~runtime.errors.BadInput`; a tree that
does not exist (or was pruned) ends the stream (:attr:`Page.found` is False); database
errors propagate to the caller, whose cursor stays valid for a new connection.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import BadInput
from runtime.store.database import Database
from runtime.store.queries import TEXT as _TEXT
from runtime.store.rows import TERMINAL_STATUSES

log = logging.getLogger(__name__)

__all__ = ["EVENT_ID_PATTERN", "START", "TERMINAL_STATUSES", "Horizon", "Page", "Position",
           "StreamEvent", "StreamReader", "TreeStream", "follow"]

#: Rows read at most per statement; a full page is followed at once by the next.
PAGE_ROWS = 500
#: Seconds between two probes of the horizon while nothing new is readable.
POLL_SECONDS = 0.01
#: A stream waits at least this many times a read's cost before the next one: on a big
#: tree (a read of a 931-task tree with 6,500 transitions takes 12 ms, each task's
#: transitions checked on its index) one reader keeps the database busy a fifth of the
#: time at most, not all of it. A read's cost is its statement's time on the server
#: (a process short of CPU would see it longer than it is), the least of the last
#: :data:`READ_COSTS`.
READ_SHARE = 4.0
READ_COSTS = 8
#: The sources, in the order they take within one transaction.
TEXT_SOURCE, EVENT_SOURCE = 0, 1
#: ``stream_read``'s last row: the statement's time on the server and its snapshot's
#: xmin, not an event.
_COST_SOURCE = 2
_BIGINT_MAX = 2**63 - 1
#: An event id: ``<txid>.<s|t|e><row id>`` (18 digits at most each: within bigint).
EVENT_ID_PATTERN = r"^(0|\d{1,18}\.[set]\d{1,18})?$"
_ID = re.compile(r"^(\d{1,18})\.([set])(\d{1,18})$")


@dataclass(frozen=True, order=True)
class Position:
    """Where an event stands in a tree's stream; its ``str`` is the SSE event id.

    Attributes:
        txid: the writing transaction (0 for transitions older than migration 0017).
        source: :data:`TEXT_SOURCE` (a piece and its superseded notice) or
            :data:`EVENT_SOURCE` (a transition).
        id: the row's id in its table.
        part: 0 for a superseded notice, 1 for the piece or transition itself.

    """

    txid: int
    source: int
    id: int
    part: int = 1

    def __str__(self) -> str:
        letter = "e" if self.source == EVENT_SOURCE else ("t" if self.part else "s")
        return f"{self.txid}.{letter}{self.id}"

    @classmethod
    def parse(cls, text: str | None) -> Position:
        """The position of an event id (``Last-Event-ID``); None or ``""`` is the start.

        Raises:
            BadInput: not an id this stream hands out.

        """
        if text is None or not text.strip() or text.strip() == "0":
            return START
        match = _ID.match(text.strip())
        if match is None:
            raise BadInput(f"bad stream event id {text!r}: expected <txid>.<s|t|e><id>, "
                           "as the stream's 'id:' lines give")
        txid, letter, row = int(match[1]), match[2], int(match[3])
        if letter == "e":
            return cls(txid, EVENT_SOURCE, row)
        return cls(txid, TEXT_SOURCE, row, 1 if letter == "t" else 0)


#: Before every event of any stream.
START = Position(0, TEXT_SOURCE, 0, 0)


@dataclass(frozen=True)
class StreamEvent:
    """One event of a tree's stream: ``text``, ``transition`` or ``superseded``.

    ``data`` is the JSON object sent as the SSE ``data:`` line (docs/api.md).
    """

    kind: str
    position: Position
    data: dict[str, Any]

    @property
    def id(self) -> str:
        """The event's id (the cursor to resume after it)."""
        return str(self.position)

    def as_json(self) -> dict[str, Any]:
        """``{"event", "id", "data"}``: the event as the client library hands it out."""
        return {"event": self.kind, "id": self.id, "data": self.data}


@dataclass
class Page:
    """What one read found: the events after the cursor, and whether the stream ended."""

    events: list[StreamEvent] = field(default_factory=list)
    ended: bool = False
    found: bool = True
    full: bool = False
    #: Seconds the read's main statement took on the server.
    cost: float = 0.0
    #: The read's snapshot's xmin: when the page is not full, every row of the tree below
    #: it has been read (the next read's ``seen``).
    xmin: int = 0


def _events_of(row: Any) -> list[StreamEvent]:
    """The events of one ``stream_read`` row: a transition, or a piece (and its notice)."""
    txid = int(row.txid)
    task = str(row.task_id)
    if row.source == EVENT_SOURCE:
        at = row.at.isoformat() if row.at is not None else None
        return [StreamEvent("transition", Position(txid, EVENT_SOURCE, row.id), {
            "task_id": task, "from": row.from_status, "to": row.to_status, "at": at,
            "agent": row.agent})]
    events = []
    if row.superseded is not None:
        events.append(StreamEvent("superseded", Position(txid, TEXT_SOURCE, row.id, 0), {
            "task_id": task, "phase": row.phase, "call": row.call_index,
            "attempt": row.superseded, "by": row.attempt}))
    events.append(StreamEvent("text", Position(txid, TEXT_SOURCE, row.id), {
        "task_id": task, "phase": row.phase, "call": row.call_index,
        "attempt": row.attempt, "offset": row.offset, "text": row.text}))
    return events


class StreamReader:
    """Reads a tree's stream: :meth:`read` a page, :meth:`probe` cheaply: ``store.streams``.

    Args:
        database: the store's :class:`~runtime.store.database.Database`.
        page_rows: rows read at most per statement.

    """

    def __init__(self, database: Database, page_rows: int = PAGE_ROWS) -> None:
        self.database = database
        self.page_rows = page_rows

    def probe(self) -> int:
        """The snapshot's xmin now: while it stands still, nothing new is readable."""
        with self.database.connect() as conn:
            return int(conn.execute(_TEXT["stream_horizon"]).scalar_one())

    def root_status(self, root_id: uuid.UUID) -> str | None:
        """The root's status now; None when ``root_id`` is no tree's root."""
        with self.database.connect() as conn:
            row = conn.execute(_TEXT["stream_root_end"], {"root_id": root_id}).first()
        return None if row is None else str(row.status)

    def exists(self, root_id: uuid.UUID) -> bool:
        """Whether ``root_id`` is the root of a tree."""
        return self.root_status(root_id) is not None

    def read(self, root_id: uuid.UUID, after: Position, seen: int = 0) -> Page:
        """The events after ``after`` that are readable now (at most a page of rows).

        One REPEATABLE READ transaction: the root's end and the rows come from one
        snapshot, so a stream never shows a row after the root's terminal transaction.
        ``seen``: 0, or the :attr:`Page.xmin` of an earlier read of this stream that was
        not a full page (every row below it was read then): the transitions are then read
        from it on, on the ``(txid, id)`` index (what was written since, whatever the
        tree's size), instead of each of the tree's tasks' on ``(task_id, id)``.
        """
        options = {"isolation_level": "REPEATABLE READ", "postgresql_readonly": True}
        with self.database.connect().execution_options(**options) as conn, conn.begin():
            root = conn.execute(_TEXT["stream_root_end"], {"root_id": root_id}).first()
            if root is None:
                return Page(ended=True, found=False)
            until = root.end_txid
            text_after = ((after.txid, after.id) if after.source == TEXT_SOURCE
                          else (after.txid, _BIGINT_MAX))
            event_after = ((after.txid, after.id) if after.source == EVENT_SOURCE
                           else (after.txid, -1))
            rows = conn.execute(_TEXT["stream_read"], {
                "root_id": root_id, "text_txid": str(text_after[0]),
                "text_id": text_after[1], "event_txid": str(event_after[0]),
                "event_id": event_after[1], "until_txid": until, "seen_txid": str(seen),
                "limit": self.page_rows}).all()
        last = next(r for r in rows if r.source == _COST_SOURCE)
        cost, xmin = float(last.elapsed), int(last.txid)
        rows = sorted((r for r in rows if r.source != _COST_SOURCE),
                      key=lambda r: (int(r.txid), r.source, r.id))
        events = [e for row in rows for e in _events_of(row) if e.position > after]
        full = len(rows) >= self.page_rows
        return Page(events, ended=until is not None and not full, full=full, cost=cost,
                    xmin=xmin)


class TreeStream:
    """A cursor over one tree's stream: each :meth:`step` returns what is new.

    Shared by the sync follower (:func:`follow`) and the server's async one: a step
    probes the horizon, reads only when it moved (or the last page was full), and moves
    the cursor past what it returns.
    """

    def __init__(self, reader: StreamReader, root_id: uuid.UUID,
                 after: Position = START, poll_seconds: float = POLL_SECONDS) -> None:
        self.reader = reader
        self.root_id = root_id
        self.cursor = after
        self.poll_seconds = poll_seconds
        self.ended = False
        self.found = True
        self._horizon: int | None = None
        #: The xmin below which every row of the tree was read (0: not yet).
        self._seen = 0
        self._more = True
        self._reads: deque[float] = deque(maxlen=READ_COSTS)

    def wants(self, horizon: int | None) -> bool:
        """Whether a step would read, given what a shared :class:`Horizon` saw.

        None: unknown, the step probes the horizon itself.
        """
        return self._more or horizon is None or horizon != self._horizon

    def step(self, horizon: int | None = None) -> list[StreamEvent]:
        """The events readable now after the cursor (maybe none); sets :attr:`ended`.

        ``horizon``: the xmin a shared :class:`Horizon` saw (it must have been probed
        before this call); None: probe it here.
        """
        if not self._more:
            if horizon is None:
                horizon = self.reader.probe()
            if horizon == self._horizon:
                return []
            self._horizon = horizon
        page = self.reader.read(self.root_id, self.cursor, self._seen)
        self._reads.append(page.cost)
        self._more = page.full
        if not page.full and page.found:
            self._seen = max(self._seen, page.xmin)
        if page.events:
            self.cursor = page.events[-1].position
        self.ended, self.found = page.ended, page.found
        return page.events

    @property
    def waiting(self) -> bool:
        """True when the next step should come after a pause (nothing was left unread)."""
        return not self._more and not self.ended

    def pause(self) -> float:
        """Seconds to wait before the next step: the poll, or more after a long read."""
        return max(self.poll_seconds, READ_SHARE * min(self._reads, default=0.0))


class Horizon:
    """One probe of the horizon for all the streams of a process (the API's).

    A thread probes every ``poll_seconds`` while a stream is subscribed, so N readers cost
    one trivial statement per poll, not N. A stream reads only when the value moved.

    A value is the xmin seen by a probe that finished before :meth:`value` returned it:
    a stream that read after seeing ``h`` has read every row below ``h``, so while the
    value stays ``h`` there is nothing new for it (:meth:`TreeStream.wants`).
    """

    def __init__(self, reader: StreamReader, poll_seconds: float = POLL_SECONDS) -> None:
        self.reader = reader
        self.poll_seconds = poll_seconds
        self._value: int | None = None
        self._users = 0
        self._lock = threading.Lock()
        self._running = False

    def value(self) -> int | None:
        """The newest xmin probed (None before the first probe, or after a failed one)."""
        return self._value

    def subscribe(self) -> None:
        """A stream starts: probe while any is subscribed."""
        with self._lock:
            self._users += 1
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="stream-horizon", daemon=True).start()

    def unsubscribe(self) -> None:
        """A stream ended."""
        with self._lock:
            self._users -= 1

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._users <= 0:
                    self._running = False
                    self._value = None
                    return
            try:
                self._value = self.reader.probe()
            except Exception:  # the streams probe themselves meanwhile (value None)
                self._value = None
                log.warning("the streams' horizon probe failed", exc_info=True)
            time.sleep(self.poll_seconds)


def follow(reader: StreamReader, root_id: uuid.UUID, after: Position = START, *,
           poll_seconds: float = POLL_SECONDS,
           stop: Callable[[], bool] | None = None) -> Iterator[StreamEvent]:
    """Yield a tree's events after ``after`` as they become readable, until it ends.

    Args:
        reader: the database's stream reader.
        root_id: the tree's root.
        after: the position to resume after (:data:`START`: the whole stream).
        poll_seconds: the pause between two probes while nothing is new.
        stop: checked between reads; True ends the iteration early.

    """
    stream = TreeStream(reader, root_id, after, poll_seconds)
    while not stream.ended and not (stop is not None and stop()):
        yield from stream.step()
        if stream.waiting:
            time.sleep(stream.pause())
