"""The journal of model replies: each reply durable the moment it arrives, then charged.

A reply's charge (``store.spend.charge_many``) updates its task's spend and locks its
tree's fair-time clock, so the charges of one tree wait for each other: in a burst of
900 answers a reply was durable 150 ms after it was parsed, and a process-group SIGKILL
(the worker and its recorder together) lost nearly every answer already sent (issue 44).
So the recorder process first *journals* each reply (``call_replies``, migration 0019):
one multi-row INSERT of the rows that arrived together, nothing else locked, committed
at once (:meth:`CallReplies.journal`); the charge follows as before.

A delivery that runs a task again *adopts* its earlier deliveries' replies whose charge
never committed (:meth:`CallReplies.adopt`, under its own lease, exactly once): each
becomes the ``model_calls`` row its charge would have written, charged to the task, and
the record look-up replays it as any recorded reply. Journal rows whose charge committed
stay until the task's next delivery adopts (and deletes) its journal, or the tree is
pruned (they cascade with their task): one narrow row per call, no second statement per
reply to delete it. The statements are in ``call_replies.sql``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from runtime.jsoncodec import dumps_fast
from runtime.records import ModelCharge
from runtime.store.queries import load_queries
from runtime.store.spend import charge_record

#: The statements of ``call_replies.sql``.
CALL_REPLIES_QUERIES = load_queries(Path(__file__).with_name("call_replies.sql"))
_JOURNAL = sa.text(CALL_REPLIES_QUERIES["call_replies_journal"])
_FENCE = sa.text(CALL_REPLIES_QUERIES["call_replies_fence"])
_ADOPT = sa.text(CALL_REPLIES_QUERIES["call_replies_adopt"])


class CallReplies:
    """Journaling replies and adopting a task's journal (see the module doc).

    Args:
        engine: the database's engine (the recorder's own, or the worker's).

    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def journal(self, charges: Sequence[ModelCharge], conn: Connection | None = None) -> int:
        """Journal the replies of ``charges`` in one statement, committed; how many.

        ``conn``: a connection of the caller's own, idle (its transaction is committed
        here); else one from the engine's pool.

        A batch the database refuses as a whole (a NUL byte in one reply, say) is
        journaled one reply at a time, so a bad one is left out alone (its charge still
        follows, and fails or records it as before).
        """
        if not charges:
            return 0
        params = {"batch": dumps_fast([charge_record(c) for c in charges])}
        try:
            if conn is None:
                with self.engine.begin() as own:
                    own.execute(_JOURNAL, params)
            else:
                with conn.begin():
                    conn.execute(_JOURNAL, params)
        except sa.exc.DataError:
            if len(charges) == 1:
                return 0
            return sum(self.journal([c], conn) for c in charges)
        return len(charges)

    def adopt(self, tasks: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> int:
        """Adopt the journaled replies of ``tasks`` (id, lease token); how many were.

        Only tasks still held under the given token adopt (the fence); each earlier
        delivery's reply whose charge never committed is recorded and charged once
        (``call_replies_adopt``).
        """
        if not tasks:
            return 0
        batch = dumps_fast([{"id": str(task), "token": str(token)} for task, token in tasks])
        with self.engine.begin() as conn:
            if not conn.execute(_FENCE, {"batch": batch}).first():
                return 0
            return int(conn.execute(_ADOPT, {"batch": batch}).one().adopted)
