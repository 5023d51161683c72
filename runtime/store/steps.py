"""Durable steps: a step's begin and finish, fenced by the lease; replays; tool approvals.

A part of the store (``store.steps``, :class:`Steps`). A step (``ctx.step``, or one tool
call of a model's tool loop) is one row of ``task_steps`` keyed by ``(task, phase,
position, name)``: :meth:`Steps.begin` records it ``started`` (or finds it ``finished``
with the same arguments: a replay), :meth:`Steps.finish` records its result or error and
charges its cost (a tool's ``cost_usd``). Both statements read the task row ``FOR SHARE``
with its lease token, so a worker whose lease was taken away writes nothing. A fork's
branch task may be served its counterpart's finished step (:meth:`Steps.from_counterpart`).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from typing import Any

from sqlalchemy.engine import Connection

from runtime.jsoncodec import dumps_fast
from runtime.store.database import Database
from runtime.store.queries import TEXT as _TEXT
from runtime.store.queries import Task
from runtime.store.rows import StepBegin, StepEnd, StepRecord

log = logging.getLogger(__name__)


def step_begin_params(begin: StepBegin) -> dict[str, Any]:
    """The ``task_step_begin`` statement's parameters (also ``task_step_from_counterpart``'s)."""
    return {"task_id": begin.task_id, "token": begin.lease_token, "phase": begin.phase,
            "position": begin.position, "name": begin.name, "kind": begin.kind,
            "args": begin.args, "args_hash": begin.args_hash,
            "idempotency_key": begin.idempotency_key,
            "tool_call_id": begin.tool_call_id, "attempt": begin.attempt}


def step_end_params(end: StepEnd) -> dict[str, Any]:
    """The ``task_step_finish`` statement's parameters."""
    return {"task_id": end.task_id, "token": end.lease_token, "step_id": end.step_id,
            "starts": end.starts, "status": "failed" if end.error is not None else "finished",
            "result": None if end.error is not None else dumps_fast(end.result),
            "error": end.error, "tries": end.tries, "usd": str(end.cost_usd),
            "duration_seconds": end.duration_seconds}


def step_record(row: Any, replayed: bool | None = None) -> StepRecord:
    """A step row as a :class:`StepRecord` (``replayed`` overrides the row's flag)."""
    return StepRecord(step_id=int(row.id), status=str(row.status), starts=int(row.starts),
                      replays=int(row.replays), result=row.result, error=row.error,
                      idempotency_key=str(row.idempotency_key),
                      replayed=bool(row.replayed) if replayed is None else replayed)



class Steps:
    """Recording durable steps (begin, finish) and reading them back: ``store.steps``."""

    def __init__(self, database: Database) -> None:
        self.database = database

    @contextlib.contextmanager
    def _autocommit(self) -> Iterator[Connection]:
        """A connection on which each statement is its own transaction (no BEGIN/COMMIT)."""
        with self.database.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT")

    def begin(self, begin: StepBegin) -> StepRecord | None:
        """Record a step as started, or return its finished record; None: the lease is gone.

        The 'started' marker commits without waiting for the disk (see ``queries.sql``).
        """
        with self._autocommit() as conn:
            row = conn.execute(_TEXT["task_step_begin"], step_begin_params(begin)).first()
        if row is None:
            log.warning("late step ignored: lease gone", extra={"task_id": str(begin.task_id),
                                                                "step": begin.name})
            return None
        return step_record(row)

    def from_counterpart(self, begin: StepBegin, counterpart: uuid.UUID) -> StepRecord | None:
        """A branch task's step served from its counterpart's record, or None (see the SQL).

        The counterpart finished the same step (place, name and arguments): the branch's
        row is recorded finished with its result, and the step does not run.
        """
        with self.database.transaction() as conn:
            row = conn.execute(_TEXT["task_step_from_counterpart"],
                               {**step_begin_params(begin), "counterpart": counterpart}).first()
        if row is None:
            return None
        return step_record(row, replayed=True)

    def finish(self, end: StepEnd) -> bool:
        """Record a step's result or error (and charge its cost); False: the lease is gone.

        One statement in its own transaction (autocommit: one round trip), committed
        durably: the recorded result is what keeps the step's side effect from running
        again, so it must survive a crash of the database server too. (The begin's
        'started' marker commits without waiting for the disk: this commit flushes it.)
        Coroutines use :class:`runtime.engine.step_writer.AsyncStepWriter` instead (the
        same statement, no thread hop).
        """
        with self._autocommit() as conn:
            row = conn.execute(_TEXT["task_step_finish"], step_end_params(end)).first()
        if row is None:
            log.warning("late step result ignored: lease gone",
                        extra={"task_id": str(end.task_id), "step_id": end.step_id})
            return False
        return True

    def tool_approval(self, task_id: uuid.UUID, lease_token: uuid.UUID, phase: str,
                      call_id: str, tool: str, args_hash: str, args: str) -> str | None:
        """The decision on one tool call (``approved``, ``denied``), or ``asked`` now.

        ``asked``: no person decided on this call (this tool, these arguments) yet; the
        ask is recorded and the caller holds the task. None: the lease is gone.
        """
        with self.database.transaction() as conn:
            row = conn.execute(_TEXT["tool_approval_ask"], {
                "task_id": task_id, "token": lease_token, "phase": phase,
                "call_id": call_id, "tool": tool, "args_hash": args_hash, "args": args,
            }).first()
        return None if row is None else str(row.status)

    def finished_at(self, task_id: uuid.UUID, phase: str, position: str, name: str,
                    args_hash: str) -> bool:
        """Whether ``task_id`` finished the step at this place with these arguments."""
        with self.database.connect() as conn:
            return conn.execute(_TEXT["task_step_finished_at"], {
                "task_id": task_id, "phase": phase, "position": position, "name": name,
                "args_hash": args_hash}).first() is not None

    def tool_approvals(self, task_id: uuid.UUID) -> list[Task]:
        """The asks and decisions on a task's tool calls."""
        return self.database.query("tool_approval_list", id=task_id)

    def for_task(self, task_id: uuid.UUID) -> list[Task]:
        """The steps and tool calls of one task, in the order they first started."""
        return self.database.query("task_list_steps", id=task_id)
