"""The steering commands of the store: cancel, pause and resume, answers, approvals.

``store.steering`` (:class:`Steering`). See :mod:`runtime.store.steering` for what each
command guarantees.
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from runtime.store.database import Database
from runtime.store.queries import TEXT as _TEXT
from runtime.store.rows import HUMAN_AGENT, TERMINAL_STATUSES, NotFound, canonical_json
from runtime.store.steering.types import (
    CancelOutcome,
    GateRow,
    SteeringConflict,
    SteeringRefused,
    SteerOutcome,
    validate_answer,
)
from runtime.store.transitions import STEER_LOCK_CLASS, Transitions

#: How many times a cancel repeats its statement to catch tasks that became open while it
#: ran without taking the tree's steering lock (a person's resolve of an escalated task);
#: delegations and retries of children hold the lock, so the second pass normally finds none.
CANCEL_PASSES = 5
#: SQLSTATE of a deadlock: a cancel that lost one to a worker's batch is run again.
DEADLOCK_SQLSTATE = "40P01"


class Steering:
    """The steering commands of the store (see :mod:`runtime.store.steering`).

    ``transitions`` is the store's :class:`~runtime.store.transitions.Transitions`, whose
    fan-in (``children_ended``) and spend roll-up (``roll_up``) a task ended here goes
    through, in this part's transaction, exactly as for a child a worker finished.
    """

    def __init__(self, database: Database, transitions: Transitions) -> None:
        self.database = database
        self.transitions = transitions

    # ------------------------------------------------------------------ cancel
    def cancel(self, task_id: uuid.UUID, actor: str = "person",
               note: str | None = None) -> CancelOutcome:
        """Cancel a task and every open task of its subtree, in one transaction.

        Raises:
            NotFound: no such task.

        """
        for attempt in range(3):
            try:
                return self._cancel_once(task_id, actor, note)
            except sa.exc.OperationalError as exc:
                code = getattr(exc.orig, "sqlstate", None)
                if code != DEADLOCK_SQLSTATE or attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _cancel_once(self, task_id: uuid.UUID, actor: str, note: str | None) -> CancelOutcome:
        detail = f"cancelled by {actor}" + (f": {note}" if note else "")
        with self.database.transaction() as conn:
            top = conn.execute(_TEXT["task_get"], {"id": task_id}).first()
            if top is None:
                raise NotFound(f"no task {task_id}")
            self._lock_steer(conn, top.root_id)
            rows: list[Any] = []
            for _ in range(CANCEL_PASSES):
                more = conn.execute(_TEXT["task_cancel_subtree"],
                                    {"id": task_id, "actor": actor, "detail": detail,
                                     "error": detail}).all()
                rows.extend(more)
                if not more:
                    break
            if not rows:
                status = conn.execute(_TEXT["task_get"], {"id": task_id}).one().status
                said = ("already cancelled" if status == "cancelled"
                        else f"already finished ({status})")
                return CancelOutcome(task_id, 0, status,
                                     f"task {task_id} is {said}; nothing to cancel")
            ready = self._cancelled_roll_up(conn, rows, task_id, actor)
        return CancelOutcome(task_id, len(rows), "cancelled",
                             f"cancelled {len(rows)} task(s) under {task_id}",
                             ids=tuple(r.id for r in rows), parents_ready=tuple(ready))

    def _cancelled_roll_up(self, conn: Connection, rows: Sequence[Any], top: uuid.UUID,
                           actor: str) -> list[uuid.UUID]:
        """Roll the cancelled tasks' spend up level by level, then fan in the top's parent.

        Deepest level first: a cancelled leaf's spend reaches its (cancelled, locked)
        parent before that parent's own spend is rolled into its parent in turn. The
        top's parent is outside the subtree: ``children_ended`` locks it, rolls up the
        top and flips it ready when the top was its last open child.
        """
        by_depth: dict[int, list[uuid.UUID]] = {}
        head = None
        for r in rows:
            if r.id == top:
                head = r
            else:
                by_depth.setdefault(r.depth, []).append(r.id)
        for depth in sorted(by_depth, reverse=True):
            self.transitions.roll_up(conn, by_depth[depth])
        if head is None:
            return []
        return self.transitions.children_ended(conn, [head], actor)

    def stopped(self, task_ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """Of the given tasks, the ones a worker must stop: cancelled, or gone."""
        gate = self.gate_calls(task_ids)
        return {i for i in task_ids if gate.get(i, GateRow(None, False)).stopped}

    def gate_calls(self, task_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, GateRow]:
        """Whether each task may start a model call now (one read for a wave of calls)."""
        if not task_ids:
            return {}
        with self.database.connect() as conn:
            rows = conn.execute(_TEXT["task_gate_calls"], {"ids": list(task_ids)}).all()
        return {r.id: GateRow(r.status, bool(r.paused), r.lease_token) for r in rows}

    def gate_calls_held(self, task_ids: Sequence[uuid.UUID]
                        ) -> tuple[dict[uuid.UUID, GateRow], Callable[[], None]]:
        """:meth:`gate_calls` under the trees' steering locks, held until ``release()``.

        The caller starts the calls the answer allows, then releases: a cancel or a pause
        of these trees (``tree_lock_steer``) waits for that, so it cannot commit between
        this read and the calls' start. Always call ``release`` (it ends the transaction).
        """
        conn = self.database.connect()
        try:
            tx = conn.begin()
            conn.execute(_TEXT["tree_lock_steer_shared"],
                         {"ids": list(task_ids), "lock_class": STEER_LOCK_CLASS})
            rows = conn.execute(_TEXT["task_gate_calls"], {"ids": list(task_ids)}).all()
        except BaseException:
            conn.close()
            raise

        released = threading.Lock()

        def release() -> None:  # idempotent: a second call does nothing
            if not released.acquire(blocking=False):
                return
            try:
                tx.commit()
            finally:
                conn.close()

        return {r.id: GateRow(r.status, bool(r.paused), r.lease_token) for r in rows}, release

    @staticmethod
    def _lock_steer(conn: Connection, root_id: uuid.UUID) -> None:
        """Take the tree's steering lock (see ``tree_lock_steer``) in this transaction."""
        conn.execute(_TEXT["tree_lock_steer"], {"root_id": root_id,
                                                "lock_class": STEER_LOCK_CLASS})

    # ------------------------------------------------------------------ pause
    def pause(self, root_id: uuid.UUID, actor: str = "person",
              note: str | None = None) -> SteerOutcome:
        """Pause a tree: its tasks are not claimed and start no model call.

        Raises:
            NotFound: no such task.
            SteeringRefused: the task is not a root.

        """
        with self.database.transaction() as conn:
            root = self._root(conn, root_id)
            self._lock_steer(conn, root_id)
            row = conn.execute(_TEXT["tree_pause_insert"],
                               {"root_id": root_id, "actor": actor, "note": note}).first()
        if row is None:
            return SteerOutcome(root_id, False, root.status, f"tree {root_id} is already paused")
        said = "" if root.status not in TERMINAL_STATUSES else f" (it is already {root.status})"
        return SteerOutcome(root_id, True, root.status, f"paused tree {root_id}{said}")

    def resume(self, root_id: uuid.UUID, actor: str = "person") -> SteerOutcome:
        """Resume a paused tree where it stood.

        Raises:
            NotFound: no such task.
            SteeringRefused: the task is not a root.

        """
        with self.database.transaction() as conn:
            root = self._root(conn, root_id)
            row = conn.execute(_TEXT["tree_pause_delete"], {"root_id": root_id}).first()
        if row is None:
            return SteerOutcome(root_id, False, root.status, f"tree {root_id} is not paused")
        return SteerOutcome(root_id, True, root.status,
                            f"resumed tree {root_id} (paused since {row.paused_at:%H:%M:%S})")

    def pause_of(self, root_id: uuid.UUID) -> dict[str, Any] | None:
        """The pause of a tree (``paused_at``, ``paused_by``, ``note``), or None."""
        with self.database.connect() as conn:
            row = conn.execute(_TEXT["tree_pause_get"], {"root_id": root_id}).first()
        return None if row is None else dict(row._mapping)

    @staticmethod
    def _root(conn: Connection, root_id: uuid.UUID) -> Any:
        root = conn.execute(_TEXT["task_get"], {"id": root_id}).first()
        if root is None:
            raise NotFound(f"no task {root_id}")
        if root.parent_id is not None:
            raise SteeringRefused(f"task {root_id} is not a root; pause or resume its root "
                                  f"{root.root_id}")
        return root

    # ------------------------------------------------------------------ approvals
    def approve(self, task_id: uuid.UUID, actor: str = "person",
                note: str | None = None) -> SteerOutcome:
        """Release a task held for approval (once: a second approve is a no-op).

        Raises:
            NotFound: no such task.

        """
        detail = f"approved by {actor}" + (f": {note}" if note else "")
        with self.database.transaction() as conn:
            row = conn.execute(_TEXT["task_approve_awaiting"],
                               {"id": task_id, "actor": actor, "detail": detail}).first()
            status = self._status(conn, task_id)
        if row is None:
            return SteerOutcome(task_id, False, status,
                                f"task {task_id} is {status}, not awaiting approval; "
                                "nothing to approve")
        return SteerOutcome(task_id, True, "pending", f"approved task {task_id}")

    def reject(self, task_id: uuid.UUID, note: str, actor: str = "person") -> SteerOutcome:
        """Fail a task held for approval with the note; its parent fans in as usual.

        Raises:
            NotFound: no such task.
            SteeringRefused: no note.

        """
        if not note or not note.strip():
            raise SteeringRefused("a rejection needs a note (--note) saying why")
        detail = f"rejected by {actor}: {note}"
        with self.database.transaction() as conn:
            rows = conn.execute(_TEXT["task_reject_awaiting"],
                                {"id": task_id, "actor": actor, "detail": detail,
                                 "error": detail}).all()
            ready = self.transitions.children_ended(conn, rows, actor) if rows else []
            status = self._status(conn, task_id)
        if not rows:
            return SteerOutcome(task_id, False, status,
                                f"task {task_id} is {status}, not awaiting approval; "
                                "nothing to reject")
        return SteerOutcome(task_id, True, "failed", f"rejected task {task_id}",
                            tuple(ready))

    # ------------------------------------------------------------------ answers
    def answer(self, task_id: uuid.UUID, answer: Any, actor: str = "person") -> SteerOutcome:
        """Answer a question to ``human``: validated, then ``done`` with the answer as result.

        Raises:
            NotFound: no such task.
            SteeringRefused: not an open question, or an answer that does not fit.

        """
        with self.database.connect() as conn:
            task = conn.execute(_TEXT["task_get"], {"id": task_id}).first()
        if task is None:
            raise NotFound(f"no task {task_id}")
        if task.to_agent != HUMAN_AGENT:
            raise SteeringConflict(f"task {task_id} is addressed to {task.to_agent!r}, not to "
                                  f"{HUMAN_AGENT!r}; only questions can be answered")
        if task.status != "pending":
            raise SteeringConflict(f"task {task_id} is {task.status}; it is no longer an open "
                                  "question")
        validate_answer(task.payload, answer)
        with self.database.transaction() as conn:
            rows = conn.execute(_TEXT["task_answer_question"],
                                {"id": task_id, "answer": canonical_json(answer),
                                 "actor": actor, "detail": f"answered by {actor}"}).all()
            ready = self.transitions.children_ended(conn, rows, actor) if rows else []
            status = self._status(conn, task_id)
        if not rows:
            raise SteeringConflict(f"task {task_id} is {status}; it is no longer an open "
                                  "question")
        return SteerOutcome(task_id, True, "done", f"answered task {task_id}", tuple(ready))

    def fail_unanswered(self, worker: str = "watchdog", limit: int = 1000) -> list[uuid.UUID]:
        """Fail questions past their deadline (``budget_seconds``); returns their ids."""
        with self.database.transaction() as conn:
            return self._fail_unanswered(conn, worker, limit)

    def _fail_unanswered(self, conn: Connection, worker: str, limit: int) -> list[uuid.UUID]:
        rows = conn.execute(_TEXT["task_fail_unanswered"],
                            {"worker": worker, "limit": limit}).all()
        if rows:
            self.transitions.children_ended(conn, rows, worker)
        return [r.id for r in rows]

    # ------------------------------------------------------------------ inbox
    def inbox(self) -> list[dict[str, Any]]:
        """What waits for a person: questions, approvals, escalations (oldest first)."""
        with self.database.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(_TEXT["task_list_inbox"])]

    def inbox_older_than(self, seconds: float) -> dict[str, Any]:
        """Questions and approvals waiting longer than ``seconds``: counts and the oldest."""
        with self.database.connect() as conn:
            row = conn.execute(_TEXT["task_count_inbox_older"],
                               {"seconds": float(seconds)}).one()
        oldest: dt.datetime | None = row.oldest
        return {"questions": int(row.questions), "approvals": int(row.approvals),
                "oldest": oldest}

    @staticmethod
    def _status(conn: Connection, task_id: uuid.UUID) -> str:
        row = conn.execute(_TEXT["task_get"], {"id": task_id}).first()
        if row is None:
            raise NotFound(f"no task {task_id}")
        return str(row.status)
