"""Streamed model-call text: pieces written to ``call_text`` in batches, fenced by lease.

A part of the store (``store.call_text``, :class:`CallText`). One statement
(``call_text_write_many`` in ``call_text.sql``) writes a batch of pieces of many calls:
each piece is keyed by ``(task, phase, call_index, attempt, offset)`` and
written only under its task's current lease token; a piece already stored is not stored
again (``NOT EXISTS``; the unique violation of a race is the writer's to write again). A
stream's first piece comes without an attempt: the statement gives it the call's next
one (see :class:`TextPiece`). The writer thread that batches pieces is
:class:`runtime.engine.text_writer.TextWriter`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from runtime.jsoncodec import dumps_fast
from runtime.store.database import Database
from runtime.store.queries import load_queries

#: The statements of ``call_text.sql``.
CALL_TEXT_QUERIES = load_queries(Path(__file__).with_name("call_text.sql"))
_WRITE_MANY = sa.text(CALL_TEXT_QUERIES["call_text_write_many"])
_CUT_OFF = sa.text(CALL_TEXT_QUERIES["call_text_cut_off"])
_NEWEST = sa.text(CALL_TEXT_QUERIES["call_text_newest"])
_RUNNING = sa.text(CALL_TEXT_QUERIES["call_text_running"])


@dataclass(frozen=True)
class TextPiece:
    """One piece of one request's output, to be written.

    Attributes:
        task_id / lease_token / phase / call_index: whose call it is, under which delivery.
        attempt: the stream's attempt, None for its first write (the statement picks the
            call's next attempt, or this delivery's row above ``known`` when an earlier
            try of the same write committed).
        known: the highest attempt this delivery's earlier streams of the call got (0: none).
        offset / text: where the text starts in the attempt's output (characters), the text.

    """

    task_id: uuid.UUID
    lease_token: uuid.UUID
    phase: str
    call_index: int
    attempt: int | None
    known: int
    offset: int
    text: str


@dataclass(frozen=True)
class PieceOutcome:
    """What became of one piece: refused (lease gone), or its attempt and whether it is ours.

    ``ours`` False: another delivery had written that attempt's row at that offset first
    (the stream must pick a new attempt and write its text again).
    """

    fenced: bool
    attempt: int | None = None
    ours: bool = False


class CallText:
    """Streamed text written in batches and read back: ``store.call_text``."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def write(self, pieces: Sequence[TextPiece]) -> list[PieceOutcome]:
        """Write ``pieces`` in one statement; one :class:`PieceOutcome` per piece, in order."""
        if not pieces:
            return []
        batch = [{"n": n, "task_id": str(p.task_id), "token": str(p.lease_token),
                  "phase": p.phase, "call_index": p.call_index, "attempt": p.attempt,
                  "known": p.known, "offset": p.offset, "text": p.text}
                 for n, p in enumerate(pieces)]
        with self.database.transaction() as conn:
            rows = conn.execute(_WRITE_MANY, {"batch": dumps_fast(batch)}).all()
        found = {int(r.n): PieceOutcome(True, int(r.attempt), bool(r.ours)) for r in rows}
        return [found.get(n, PieceOutcome(False)) for n in range(len(pieces))]

    def cut_off(self, task_id: uuid.UUID, phase: str,
                call_index: int) -> tuple[int, str] | None:
        """``(attempt, text)`` of a call cut off mid-generation (no reply recorded), or None.

        The text is the call's last attempt's pieces, put together; None when the call has
        any ``model_calls`` row, no pieces, or pieces with a gap.
        """
        with self.database.connect() as conn:
            row = conn.execute(_CUT_OFF, {"task_id": task_id, "phase": phase,
                                          "call_index": call_index}).first()
        return None if row is None else (int(row.attempt), str(row.text))

    def newest(self, root_id: uuid.UUID) -> tuple[int, int] | None:
        """``(txid, id)`` of the newest piece of a tree's text (None: no text yet; one row)."""
        with self.database.connect() as conn:
            row = conn.execute(_NEWEST, {"root_id": root_id}).first()
        return None if row is None else (int(row.txid), int(row.id))

    def running(self, root_id: uuid.UUID) -> list[dict[str, Any]]:
        """The text so far of each running task's newest call in a tree, task by task.

        Each ``{"task_id", "phase", "call", "attempt", "text"}``: the attempt of the task's
        newest piece, put together (the MCP tree resource's ``streaming``).
        """
        with self.database.connect() as conn:
            rows = conn.execute(_RUNNING, {"root_id": root_id}).all()
        return [{"task_id": str(r.task_id), "phase": r.phase, "call": int(r.call_index),
                 "attempt": int(r.attempt), "text": r.text or ""} for r in rows]
