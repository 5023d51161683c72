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
``model_calls`` by root (:meth:`Store.live_spend`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from runtime.store.queries import TEXT as _TEXT
from runtime.store.queries import Task
from runtime.store.reads import StoreReads
from runtime.store.rows import (
    TERMINAL_STATUSES,
    ChildRow,
    Finished,
    IdempotencyConflict,
    JudgeOutcome,
    ModelCharge,
    NewTask,
    NotFound,
    Reaped,
    ResolveRefused,
    RunOutcome,
    Swept,
    TaskRow,
    TimedOut,
    canonical_json,
)

log = logging.getLogger(__name__)

_dumps = canonical_json


def _dumps_fast(value: Any) -> str:
    """JSON for a batch parameter (no key sorting: nothing hashes it)."""
    return json.dumps(value, separators=(",", ":"), default=str)


def _json_or_none(value: Any) -> str | None:
    return None if value is None else _dumps(value)


#: The advisory lock key of the maintenance pass (distinct from the orchestrator's fire lock).
MAINTENANCE_LOCK_KEY = int.from_bytes(hashlib.sha256(b"orgchart:maintenance").digest()[:8],
                                      "big", signed=True)


@dataclass(frozen=True)
class Maintained:
    """What one maintenance pass did (reaper, watchdog and sweeper, in one transaction)."""

    reaped: Reaped
    timed_out: TimedOut
    swept: Swept


class Store(StoreReads):
    """The database door: named statements, one transaction per state change.

    Writes live here; reads, pruning and the orchestrator's bookkeeping come from
    :class:`runtime.store.reads.StoreReads`.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # ------------------------------------------------------------------ plumbing
    def ping(self) -> bool:
        """True when the database answers (health checks); raises on connection errors."""
        with self.engine.connect() as conn:
            return conn.execute(_TEXT["db_ping"]).scalar() == 1

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    # ------------------------------------------------------------------ submit
    def submit(self, new: NewTask, actor: str = "submit") -> tuple[Task, bool]:
        """Insert a root task; return ``(task, created)``.

        The same idempotency key with the same request returns the existing task and
        ``created=False``; with a different request it raises :class:`IdempotencyConflict`.
        """
        request_hash = new.request_hash()
        params = {
            "id": uuid.uuid4(),
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
            "idempotency_key": new.idempotency_key,
            "request_hash": request_hash,
            "actor": actor,
        }
        with self.transaction() as conn:
            rows = self._rows(conn, "task_insert_root", **params)
            if rows:
                task = rows[0]
                task.pop("notified", None)
                return task, True
            existing = self._rows(conn, "task_get_by_root_key", key=new.idempotency_key)
        if not existing:  # the conflicting row was pruned between the two statements
            return self.submit(new, actor)
        task = existing[0]
        if task["request_hash"] != request_hash:
            raise IdempotencyConflict(str(new.idempotency_key), task["id"])
        return task, False

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
                },
            ).one()
        return int(row.inserted)

    # ------------------------------------------------------------------ claim
    def _task_rows(self, conn: Connection, name: str, **params: Any) -> list[TaskRow]:
        """Run a named read and type its rows (the one place tasks become ``TaskRow``)."""
        result = conn.execute(_TEXT[name], params)
        return TaskRow.from_rows(list(result.keys()), result.all())

    def claim(self, agents: Sequence[str], limit: int, worker: str,
              lease_seconds: float) -> list[TaskRow]:
        """Claim up to ``limit`` pending or ready-to-aggregate tasks for ``agents``."""
        if not agents or limit <= 0:
            return []
        with self.transaction() as conn:
            return self._task_rows(conn, "task_claim_available", agents=list(agents),
                                   limit=limit, worker=worker,
                                   lease_seconds=float(lease_seconds))

    def claim_judging(self, limit: int, worker: str, lease_seconds: float) -> list[TaskRow]:
        """Lease up to ``limit`` tasks waiting for the judge stage."""
        if limit <= 0:
            return []
        with self.transaction() as conn:
            return self._task_rows(conn, "task_claim_judging", limit=limit, worker=worker,
                                   lease_seconds=float(lease_seconds))

    def child_rows(self, task_id: uuid.UUID) -> list[TaskRow]:
        """The children of one task as typed rows, in creation order (for the engine)."""
        with self.engine.connect() as conn:
            return self._task_rows(conn, "task_list_children", id=task_id)

    def heartbeat(self, tokens: Iterable[uuid.UUID], lease_seconds: float) -> set[uuid.UUID]:
        """Extend leases; return the tokens still held (the others were taken away)."""
        tokens = list(tokens)
        if not tokens:
            return set()
        with self.transaction() as conn:
            rows = conn.execute(_TEXT["task_heartbeat_leased"],
                                {"tokens": tokens, "lease_seconds": float(lease_seconds)})
            return {row.lease_token for row in rows}

    def release(self, tokens: Iterable[uuid.UUID], worker: str) -> int:
        """Hand back leased tasks (a worker shutting down); returns how many."""
        tokens = list(tokens)
        if not tokens:
            return 0
        with self.transaction() as conn:
            return len(conn.execute(_TEXT["task_release_leased"],
                                    {"tokens": tokens, "worker": worker}).all())

    # ------------------------------------------------------------------ finish
    def finish_running(self, outcomes: Sequence[RunOutcome], worker: str) -> Finished:
        """Apply a batch of run outcomes in one transaction, then fan-in their parents."""
        return self._finish("task_finish_running", [
            {"id": o.task_id, "token": o.lease_token, "to_status": o.to_status,
             "result": o.result, "error": o.error, "delay": float(o.delay_seconds),
             "detail": o.detail, "verdict": o.verdict}
            for o in outcomes
        ], outcomes, worker)

    def finish_judging(self, outcomes: Sequence[JudgeOutcome], worker: str) -> Finished:
        """Apply a batch of verdicts in one transaction, then fan-in their parents."""
        return self._finish("task_finish_judging", [
            {"id": o.task_id, "token": o.lease_token, "to_status": o.to_status,
             "verdict": o.verdict, "error": o.error, "detail": o.detail}
            for o in outcomes
        ], outcomes, worker)

    def _finish(self, query: str, batch: list[dict[str, Any]],
                outcomes: Sequence[RunOutcome] | Sequence[JudgeOutcome],
                worker: str) -> Finished:
        """One guarded batch statement (with its events), then the ended children's fan-in."""
        done = Finished()
        if not outcomes:
            return done
        with self.transaction() as conn:
            rows = conn.execute(_TEXT[query], {"batch": _dumps_fast(batch),
                                               "worker": worker}).all()
            done.applied = [r.id for r in rows]
            done.parents_ready = self._children_ended(
                conn, [r for r in rows if r.status in TERMINAL_STATUSES], worker)
        self._log_stale(outcomes, done)
        return done

    def _children_ended(self, conn: Connection, ended: Sequence[Any],
                        worker: str) -> list[uuid.UUID]:
        """Children reached a terminal status: roll their spend up, then fan in.

        ``ended`` are rows with ``id`` and ``parent_id``; runs in the caller's transaction.
        """
        return self._fan_in(conn, {r.parent_id for r in ended if r.parent_id is not None},
                            worker, ended_children=[r.id for r in ended])

    @staticmethod
    def _roll_up(conn: Connection, child_ids: Sequence[uuid.UUID]) -> None:
        """Add terminal children's spend since their last roll-up to their locked parents."""
        rolled = conn.execute(_TEXT["task_roll_up_children"], {"ids": list(child_ids)}).all()
        if not rolled:
            return
        tokens: dict[uuid.UUID, int] = {}
        usd: dict[uuid.UUID, Decimal] = {}
        for r in rolled:
            tokens[r.parent_id] = tokens.get(r.parent_id, 0) + int(r.tokens)
            usd[r.parent_id] = usd.get(r.parent_id, Decimal(0)) + Decimal(r.usd)
        ids = sorted(tokens)
        conn.execute(_TEXT["task_add_children_spend"],
                     {"ids": ids, "tokens": [tokens[i] for i in ids],
                      "usd": [usd[i] for i in ids]})

    def _fan_in(self, conn: Connection, parent_ids: set[uuid.UUID], worker: str,
                ended_children: Sequence[uuid.UUID] = ()) -> list[uuid.UUID]:
        """Lock the parents (in id order), roll up their ended children's spend, flip ready ones.

        All in the caller's transaction: two transactions finishing the last two children
        of one parent serialise on the parent's lock, and the second sees the first.
        """
        if not parent_ids:
            return []
        ids = sorted(parent_ids)
        conn.execute(_TEXT["task_lock_parents"], {"ids": ids})
        if ended_children:
            self._roll_up(conn, ended_children)
        rows = conn.execute(_TEXT["task_flip_ready_parents"], {"ids": ids, "worker": worker})
        return [r.id for r in rows]

    @staticmethod
    def _log_stale(outcomes: Sequence[RunOutcome] | Sequence[JudgeOutcome],
                   done: Finished) -> None:
        applied = set(done.applied)
        for o in outcomes:
            if o.task_id not in applied:
                done.stale.append(o.task_id)
                log.warning(
                    "late write ignored: lease gone",
                    extra={"task_id": str(o.task_id), "to_status": o.to_status},
                )

    # ------------------------------------------------------------------ delegate
    def delegate(self, task_id: uuid.UUID, lease_token: uuid.UUID, children: Sequence[ChildRow],
                 worker: str, detail: str | None = None) -> tuple[bool, int]:
        """Move a leased running parent to ``waiting`` and insert its children atomically.

        Returns ``(applied, inserted)``: ``applied`` is False when the lease was gone
        (nothing changed); ``inserted`` counts children that did not exist yet.
        """
        return self.delegate_many([(task_id, lease_token, children, detail)], worker)[0]

    def delegate_many(self, delegations: Sequence[tuple[uuid.UUID, uuid.UUID, Sequence[ChildRow],
                                                        str | None]],
                      worker: str) -> list[tuple[bool, int]]:
        """Several delegations ``(task_id, lease_token, children, detail)``: one statement.

        Each parent is guarded by its lease token as in :meth:`delegate`; the parents
        that moved are then checked for fan-in (a re-run parent may find every child
        already finished), in the same transaction. Returns ``(applied, inserted)`` per
        delegation, in order. A payload the database refuses fails the whole call: retry
        them one by one.
        """
        if not delegations:
            return []
        batch = [
            {"id": str(task_id), "token": str(token),
             "detail": detail or f"delegated to {len(children)} children",
             "children": [
                 {"id": str(uuid.uuid4()), "to_agent": c.to_agent, "type": c.type,
                  "payload": c.payload, "success_criteria": c.success_criteria,
                  "kill_criteria": c.kill_criteria, "budget_tokens": c.budget_tokens,
                  "budget_seconds": c.budget_seconds, "budget_usd": str(c.budget_usd),
                  "priority": c.priority, "key": c.key}
                 for c in children]}
            for task_id, token, children, detail in delegations
        ]
        with self.transaction() as conn:
            moved = {row.id: int(row.inserted) for row in conn.execute(
                _TEXT["task_delegate_running_many"], {"batch": _dumps(batch), "worker": worker})}
            self._fan_in(conn, set(moved), worker)
        for task_id, _, _, _ in delegations:
            if task_id not in moved:
                log.warning("late delegation ignored: lease gone",
                            extra={"task_id": str(task_id)})
        return [(task_id in moved, moved.get(task_id, 0)) for task_id, _, _, _ in delegations]

    def retry_children(self, task_id: uuid.UUID, lease_token: uuid.UUID,
                       child_ids: Sequence[uuid.UUID], worker: str,
                       reassign_to: str | None = None, detail: str | None = None) -> int:
        """From ``aggregate``: send finished children back to pending and wait again.

        Returns how many children were re-queued (0 when the parent's lease was gone).
        """
        what = f"reassigned to {reassign_to}" if reassign_to else "retried"
        with self.transaction() as conn:
            row = conn.execute(
                _TEXT["task_retry_children"],
                {"id": task_id, "token": lease_token, "child_ids": list(child_ids),
                 "reassign_to": reassign_to, "worker": worker,
                 "detail": detail or f"{what} by the parent's aggregate"},
            ).one()
            if row.parents:
                self._fan_in(conn, {task_id}, worker)
        if not row.parents:
            log.warning("late retry ignored: lease gone", extra={"task_id": str(task_id)})
        return int(row.children)

    # ------------------------------------------------------------------ spend
    def charge(self, charge: ModelCharge) -> bool:
        """Record one model call and charge it to its task only (one row, one insert).

        The spend reaches the ancestors when the task ends (:meth:`_children_ended`).
        Returns False (nothing written) when the task's lease is gone.
        """
        with self.transaction() as conn:
            row = conn.execute(
                _TEXT["task_charge_running"],
                {
                    "id": charge.task_id, "token": charge.lease_token,
                    "tokens": charge.prompt_tokens + charge.completion_tokens,
                    "usd": charge.cost_usd, "route": charge.route,
                    "route_reason": charge.route_reason, "model": charge.model,
                    "attempt": charge.attempt, "call_index": charge.call_index,
                    "backend": charge.backend, "prompt": charge.prompt,
                    "response": charge.response, "prompt_tokens": charge.prompt_tokens,
                    "completion_tokens": charge.completion_tokens,
                    "duration_seconds": charge.duration_seconds, "error": charge.error,
                    "phase": charge.phase, "position": charge.position,
                    "request_hash": charge.request_hash, "attempt_kind": charge.attempt_kind,
                    "call_try": charge.call_try, "replayed": charge.replayed,
                    "thinking": charge.thinking,
                },
            ).first()
        if row is None:
            log.warning("late charge ignored: lease gone", extra={"task_id": str(charge.task_id)})
            return False
        return True

    def charge_many(self, charges: Sequence[ModelCharge]) -> list[bool]:
        """Charge a batch of model calls in one statement; True for each one recorded.

        Each call is guarded by its task's lease token like :meth:`charge`; several calls
        of one task add up. A batch the database refuses as a whole (a NUL byte in one
        prompt, say) is retried one call at a time, so a bad row fails alone.
        """
        if not charges:
            return []
        batch = [
            {"n": n, "id": str(c.task_id), "token": str(c.lease_token),
             "tokens": c.prompt_tokens + c.completion_tokens, "usd": str(c.cost_usd),
             "route": c.route, "route_reason": c.route_reason, "model": c.model,
             "attempt": c.attempt, "call_index": c.call_index, "backend": c.backend,
             "prompt": c.prompt, "response": c.response, "prompt_tokens": c.prompt_tokens,
             "completion_tokens": c.completion_tokens,
             "duration_seconds": c.duration_seconds, "error": c.error, "phase": c.phase,
             "position": c.position, "request_hash": c.request_hash,
             "attempt_kind": c.attempt_kind, "call_try": c.call_try, "replayed": c.replayed,
             "thinking": c.thinking}
            for n, c in enumerate(charges)
        ]
        try:
            with self.transaction() as conn:
                done = {r.n for r in conn.execute(_TEXT["task_charge_running_many"],
                                                  {"batch": _dumps_fast(batch)})}
        except sa.exc.DataError:
            if len(charges) == 1:
                raise
            return [ok for c in charges for ok in self.charge_many([c])]
        for n, c in enumerate(charges):
            if n not in done:
                log.warning("late charge ignored: lease gone", extra={"task_id": str(c.task_id)})
        return [n in done for n in range(len(charges))]

    def live_spend(self, root_id: uuid.UUID) -> tuple[int, Decimal, int]:
        """``(tokens, usd, calls)`` a tree has spent so far, running tasks included."""
        with self.engine.connect() as conn:
            row = conn.execute(_TEXT["model_call_spend_by_root"], {"root_id": root_id}).one()
        return int(row.tokens), Decimal(row.usd), int(row.calls)

    # ------------------------------------------------------------------ hygiene
    def maintain(self, max_delivery: int, interval_seconds: float, *, reap_limit: int = 1000,
                 timeout_limit: int = 1000, sweep_limit: int = 10_000,
                 name: str = "maintenance") -> Maintained | None:
        """One maintenance pass for all workers: reaper, watchdog and sweeper, once per interval.

        Runs in one transaction under a transaction-level advisory lock: while one worker
        runs it the others skip, and a pass that ran less than ``interval_seconds`` ago
        (by the database clock) is not repeated. Returns None when skipped.
        """
        with self.transaction() as conn:
            began = conn.execute(_TEXT["maintenance_pass_begin"],
                                 {"key": MAINTENANCE_LOCK_KEY, "name": name,
                                  "interval": float(interval_seconds)}).first()
            if began is None:
                return None
            reaped = self._reap(conn, max_delivery, "reaper", reap_limit)
            timed_out = self._time_out(conn, "watchdog", timeout_limit)
            swept = self._sweep(conn, "sweeper", sweep_limit)
        return Maintained(reaped, timed_out, swept)

    def reap(self, max_delivery: int, worker: str = "reaper", limit: int = 1000) -> Reaped:
        """Release expired leases; poison tasks delivered ``max_delivery`` times."""
        with self.transaction() as conn:
            return self._reap(conn, max_delivery, worker, limit)

    def _reap(self, conn: Connection, max_delivery: int, worker: str, limit: int) -> Reaped:
        rows = conn.execute(_TEXT["task_reap_expired"],
                            {"max_delivery": max_delivery, "worker": worker,
                             "limit": limit}).all()
        self._children_ended(conn, [r for r in rows if r.to_status == "failed"], worker)
        poisoned = sum(1 for r in rows if r.to_status == "failed")
        return Reaped(released=len(rows) - poisoned, poisoned=poisoned,
                      ids=tuple(r.id for r in rows))

    def time_out(self, worker: str = "watchdog", limit: int = 1000) -> TimedOut:
        """Fail tasks running past their ``budget_seconds`` with ``error = 'timeout'``."""
        with self.transaction() as conn:
            return self._time_out(conn, worker, limit)

    def _time_out(self, conn: Connection, worker: str, limit: int) -> TimedOut:
        rows = conn.execute(_TEXT["task_fail_timed_out"],
                            {"worker": worker, "limit": limit}).all()
        self._children_ended(conn, rows, worker)
        return TimedOut(failed=len(rows), ids=tuple(r.id for r in rows))

    def sweep(self, worker: str = "sweeper", limit: int = 10_000) -> Swept:
        """Mark waiting parents whose children are all terminal ``ready_to_aggregate``."""
        with self.transaction() as conn:
            return self._sweep(conn, worker, limit)

    @staticmethod
    def _sweep(conn: Connection, worker: str, limit: int) -> Swept:
        rows = conn.execute(_TEXT["task_sweep_ready_parents"],
                            {"worker": worker, "limit": limit}).all()
        return Swept(ready=len(rows), ids=tuple(r.id for r in rows))

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
                self._children_ended(conn, [task], actor)
            fresh = self._rows(conn, "task_get", id=task_id)[0]
        return fresh

