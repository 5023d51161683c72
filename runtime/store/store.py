"""The one door to the database: every statement the runtime runs goes through :class:`Store`.

The statements that must be exact under concurrency live in ``runtime/store/queries.sql`` as
named blocks. Each state change is one guarded statement that also writes its
``task_events`` rows, run in one transaction; where fan-in has to follow (a child became
terminal), the parents are locked and flipped in that same transaction. A write from a
worker whose lease was taken away matches no row, changes nothing, and is logged.

Tasks handed to the engine (claims, a parent's children) are typed rows
(:class:`~runtime.store.rows.TaskRow`, built in one place: ``TaskRow.from_mapping``); the
public reads return plain dicts that :func:`runtime.views.task_json` turns into JSON.

Spend: a model call charges only its own task (and its ``model_calls`` row). A child's
spend rolls up to its parent when the child reaches a terminal status, in the transaction
that already locks the parent for fan-in; a running tree's live spend is summed from
``model_calls`` by root (:meth:`~runtime.store.spend.Spend.live`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from sqlalchemy.engine import Engine

from runtime.store.claims import StoreClaims
from runtime.store.database import Database
from runtime.store.experiments import Experiments
from runtime.store.fires import Fires
from runtime.store.hygiene import MAINTENANCE_LOCK_KEY, Hygiene, Maintained
from runtime.store.queries import TEXT as _TEXT
from runtime.store.queries import Task
from runtime.store.rows import (
    IdempotencyConflict,
    NewBranch,
    NewTask,
    NotFound,
    ResolveRefused,
    canonical_json,
)
from runtime.store.schedules import Schedules
from runtime.store.spend import Spend
from runtime.store.steering import Steering
from runtime.store.steps import Steps
from runtime.store.webhooks import Webhooks
from runtime.store.writes import StoreWrites

__all__ = ["MAINTENANCE_LOCK_KEY", "Maintained", "Store"]

_dumps = canonical_json


def _json_or_none(value: Any) -> str | None:
    return None if value is None else _dumps(value)


class Store(StoreClaims, StoreWrites):
    """The database door: named statements, one transaction per state change.

    Composed of parts, one per concern, each taking the shared
    :class:`~runtime.store.database.Database`: ``store.webhooks``
    (:class:`~runtime.store.webhooks.Webhooks`), ``store.schedules``
    (:class:`~runtime.store.schedules.Schedules`), ``store.experiments``
    (:class:`~runtime.store.experiments.Experiments`), ``store.steering`` (a person's
    hand on a running tree: cancel, pause, answers, approvals, and the model-call gate;
    :class:`~runtime.store.steering.Steering`), ``store.steps`` (durable steps and tool
    approvals; :class:`~runtime.store.steps.Steps`), ``store.spend`` (model calls
    charged, live spend, tenants' token buckets; :class:`~runtime.store.spend.Spend`),
    ``store.hygiene`` (the reaper, the watchdog, the sweeper, session locks;
    :class:`~runtime.store.hygiene.Hygiene`), ``store.fires`` (the orchestrator's fires,
    its lock, the events it counts; :class:`~runtime.store.fires.Fires`).
    No part inherits another: a part that needs the lifecycle's methods (a root's
    parameters, fan-in, the tenancy) is handed this store in its constructor.

    The task lifecycle is still built from mixins, one module per concern: submitting
    and resolving live here; reads, pruning and the orchestrator's bookkeeping
    (:class:`~runtime.store.reads.StoreReads`), claims and leases
    (:class:`~runtime.store.claims.StoreClaims`), outcomes and fan-in
    (:class:`~runtime.store.writes.StoreWrites`).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.database = Database(engine)
        #: Webhook endpoints and the outbox's deliveries.
        self.webhooks = Webhooks(self.database)
        #: Stored schedules and the ticks' transactions.
        self.schedules = Schedules(self.database, self)
        #: Datasets, experiments, their trees and their scores.
        self.experiments = Experiments(self.database, self)
        #: A person's hand on a running tree: cancel, pause, answers, approvals; the gate.
        self.steering = Steering(self.database, self)
        #: Durable steps: begin, finish, replays from a counterpart; tool approvals.
        self.steps = Steps(self.database)
        #: Model calls charged to their task, a tree's live spend, tenants' token buckets.
        self.spend = Spend(self.database, self)
        #: Maintenance: the reaper, the watchdog, the sweeper; session locks.
        self.hygiene = Hygiene(self.database, self)
        #: The orchestrator's fires, the fire lock, the event counts of a fire's rollup.
        self.fires = Fires(self.database)

    # ------------------------------------------------------------------ plumbing
    def ping(self) -> bool:
        """True when the database answers (health checks); raises on connection errors."""
        with self.engine.connect() as conn:
            return conn.execute(_TEXT["db_ping"]).scalar() == 1

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    # ------------------------------------------------------------------ submit
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
        with self.transaction() as conn:
            rows = self._rows(conn, "task_insert_root", **params)
            if rows:
                task = rows[0]
                task.pop("notified", None)
                return task, True
            existing = self._rows(conn, "task_get_by_root_key", key=new.idempotency_key)
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
            **self.approval_params(),
        }

    def fork_root(self, branch: NewBranch, actor: str = "fork") -> Task:
        """Insert a fork's branch root and its event in one statement; return the row.

        The branch re-runs the original tree from its root (``forked_from`` is the
        original root; ``fork`` says what changes where). The original is only read: its
        budgets, criteria and priority are the branch's unless the branch names its own.
        """
        with self.transaction() as conn:
            rows = self._rows(conn, "task_insert_fork_root", **self.fork_params(branch, actor))
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
            actor=actor, detail=detail, **self.approval_params())

    def submit_many(self, agent: str, type_: str, payloads: Sequence[dict[str, Any]],
                    priority: int = 5, actor: str = "submit") -> int:
        """Insert many root tasks in one statement (bulk loads, benchmarks)."""
        ids = [uuid.uuid4() for _ in payloads]
        with self.transaction() as conn:
            row = conn.execute(
                _TEXT["task_insert_roots_many"],
                {
                    "ids": ids,
                    "agents": [agent] * len(ids),
                    "types": [type_] * len(ids),
                    "payloads": [_dumps(p) for p in payloads],
                    "priorities": [priority] * len(ids),
                    "actor": actor,
                    **self.approval_params(),
                },
            ).one()
        return int(row.inserted)

    # ------------------------------------------------------------------ resolve
    def resolve(self, task_id: uuid.UUID, action: str, actor: str = "person",
                note: str | None = None, reassign_to: str | None = None) -> Task:
        """Resolve an escalated task: ``retry`` (optionally reassigned), ``done`` or ``fail``.

        Raises:
            NotFound: no such task.
            ResolveRefused: the task is not escalated, or a retry of a child whose parent
                has already aggregated.

        """
        to_status = {"retry": "pending", "reassign": "pending", "done": "done",
                     "fail": "failed"}.get(action)
        if to_status is None:
            raise ValueError(f"unknown resolution {action!r}: use retry, reassign, done or fail")
        detail = f"resolved: {action}" + (f" to {reassign_to}" if reassign_to else "")
        if note:
            detail += f"; note: {note}"
        with self.transaction() as conn:
            task = conn.execute(_TEXT["task_lock_by_id"], {"id": task_id}).first()
            if task is None:
                raise NotFound(f"no task {task_id}")
            if task.status != "escalated":
                raise ResolveRefused(
                    f"task {task_id} is {task.status}, not escalated; only escalated tasks "
                    "can be resolved"
                )
            if task.parent_id is not None:
                # Child then parent: the order fan-in uses too (it locks the finishing child
                # in its UPDATE, then the parent), so the two cannot deadlock.
                parent = conn.execute(_TEXT["task_lock_by_id"],
                                      {"id": task.parent_id}).one().status
                if to_status == "pending" and parent not in ("waiting", "ready_to_aggregate"):
                    raise ResolveRefused(
                        f"task {task_id} cannot be retried: its parent {task.parent_id} has "
                        f"already aggregated its children (parent is {parent})"
                    )
                if to_status == "pending" and parent == "ready_to_aggregate":
                    conn.execute(_TEXT["task_unready_parent"],
                                 {"id": task.parent_id, "actor": actor})
            error = f"resolved as {action} by {actor}" + (f": {note}" if note else "")
            rows = self._rows(conn, "task_resolve_escalated", id=task_id, to_status=to_status,
                              reassign_to=reassign_to, actor=actor, detail=detail,
                              error=error if to_status == "failed" else None)
            if not rows:
                raise ResolveRefused(f"task {task_id} changed while resolving; try again")
            if to_status != "pending" and task.parent_id is not None:
                self.children_ended(conn, [task], actor)
            fresh = self._rows(conn, "task_get", id=task_id)[0]
        return fresh
