"""Where a task begins: a root submitted (one, many, or a fork's branch), and its parameters.

A part of the store (``store.tasks``, :class:`Tasks`). Each insert is one statement of
``queries.sql`` with its ``task_events`` row; a root waits in 'awaiting_approval' when the
require_approval policy holds its agent. Its later moves are :mod:`runtime.store.claims`
(leased) and :mod:`runtime.store.transitions` (every status change after that).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from runtime.store.database import Database
from runtime.store.policies import Policies
from runtime.store.queries import TEXT as _TEXT
from runtime.store.queries import Task
from runtime.store.rows import IdempotencyConflict, NewBranch, NewTask, canonical_json

_dumps = canonical_json


def _json_or_none(value: Any) -> str | None:
    return None if value is None else _dumps(value)


class Tasks:
    """Inserting root tasks: submit (idempotent), many at once, a fork's branch root.

    ``store.tasks``; ``policies`` is the store's :class:`~runtime.store.policies.Policies`,
    whose require_approval holds (set by the wiring) the inserts are given. The
    parameters of a root's insert are public (:meth:`root_params`, :meth:`fork_params`):
    a schedule's slot and an experiment's run insert roots in transactions of their own.
    """

    def __init__(self, database: Database, policies: Policies) -> None:
        self.database = database
        self.policies = policies

    def submit(self, new: NewTask, actor: str = "submit",
               task_id: uuid.UUID | None = None) -> tuple[Task, bool]:
        """Insert a root task; return ``(task, created)``.

        The same idempotency key with the same request returns the existing task and
        ``created=False``; with a different request it raises :class:`IdempotencyConflict`.
        ``task_id`` (default: a new one) lets a caller whose COMMIT was in doubt look the
        task up before it submits again (:func:`runtime.wiring.submit_root`).
        """
        params = self.root_params(new, actor, task_id or uuid.uuid4())
        request_hash = params["request_hash"]
        with self.database.transaction() as conn:
            rows = self.database.rows(conn, "task_insert_root", **params)
            if rows:
                task = rows[0]
                task.pop("notified", None)
                return task, True
            existing = self.database.rows(conn, "task_get_by_root_key", key=new.idempotency_key)
        if not existing:  # the conflicting row was pruned between the two statements
            return self.submit(new, actor, task_id)
        task = existing[0]
        if task["request_hash"] != request_hash:
            raise IdempotencyConflict(str(new.idempotency_key), task["id"])
        return task, False

    def root_params(self, new: NewTask, actor: str, task_id: uuid.UUID) -> dict[str, Any]:
        """The parameters of ``task_insert_root`` for ``new`` (submit, a schedule's slot)."""
        return {
            "id": task_id,
            "from_agent": new.from_agent,
            "to_agent": new.to_agent,
            "type": new.type,
            "hypothesis_id": new.hypothesis_id,
            "payload": _dumps(new.payload),
            "success_criteria": _json_or_none(new.success_criteria),
            "kill_criteria": _json_or_none(new.kill_criteria),
            "budget_tokens": new.budget_tokens,
            "budget_seconds": new.budget_seconds,
            "budget_usd": Decimal(new.budget_usd),
            "priority": new.priority,
            "tenant": new.tenant,
            "idempotency_key": new.idempotency_key,
            "request_hash": new.request_hash(),
            "actor": actor,
            **self.policies.approval_params(),
        }

    def fork_root(self, branch: NewBranch, actor: str = "fork") -> Task:
        """Insert a fork's branch root and its event in one statement; return the row.

        The branch re-runs the original tree from its root (``forked_from`` is the
        original root; ``fork`` says what changes where). The original is only read: its
        budgets, criteria and priority are the branch's unless the branch names its own.
        """
        with self.database.transaction() as conn:
            rows = self.database.rows(conn, "task_insert_fork_root",
                                      **self.fork_params(branch, actor))
        task = rows[0]
        task.pop("notified", None)
        return task

    def fork_params(self, branch: NewBranch, actor: str) -> dict[str, Any]:
        """The parameters of ``task_insert_fork_root`` for ``branch`` (fork, experiments)."""
        original = branch.original
        note = branch.fork.get("note")
        detail = f"forked from {original['id']}" + (f": {note}" if note else "")
        return dict(
            id=uuid.uuid4(), from_agent=original.get("from_agent"), to_agent=branch.to_agent,
            type=branch.type, hypothesis_id=original.get("hypothesis_id"),
            payload=_dumps(branch.payload),
            success_criteria=_json_or_none(original.get("success_criteria")),
            kill_criteria=_json_or_none(original.get("kill_criteria")),
            budget_tokens=(branch.budget_tokens if branch.budget_tokens is not None
                           else original.get("budget_tokens")),
            budget_seconds=original.get("budget_seconds"),
            budget_usd=(branch.budget_usd if branch.budget_usd is not None
                        else original.get("budget_usd")),
            priority=original.get("priority"), forked_from=original["id"],
            tenant=original.get("tenant", "default"),
            fork=_dumps(branch.fork), model_override=branch.model_override,
            agent_map=_json_or_none(branch.agent_map),
            actor=actor, detail=detail, **self.policies.approval_params())

    def submit_many(self, agent: str, type_: str, payloads: Sequence[dict[str, Any]],
                    priority: int = 5, actor: str = "submit") -> int:
        """Insert many root tasks in one statement (bulk loads, benchmarks)."""
        ids = [uuid.uuid4() for _ in payloads]
        with self.database.transaction() as conn:
            row = conn.execute(
                _TEXT["task_insert_roots_many"],
                {
                    "ids": ids,
                    "agents": [agent] * len(ids),
                    "types": [type_] * len(ids),
                    "payloads": [_dumps(p) for p in payloads],
                    "priorities": [priority] * len(ids),
                    "actor": actor,
                    **self.policies.approval_params(),
                },
            ).one()
        return int(row.inserted)
