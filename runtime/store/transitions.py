"""Where a task's status changes: outcomes, delegation, children retried, resolutions; fan-in.

A part of the store (``store.transitions``, :class:`Transitions`): the answer to "where
does a task's status change?". A run's or a verdict's outcome, a delegation (the parent
waits, its children are inserted), an aggregate's retry of children, a person's
resolution of an escalation, and fan-in: a parent woken when its last child ends, which
every other ending runs through too (a cancel, an answer, an approval refused:
:mod:`runtime.store.steering`; the reaper and the watchdog: :mod:`runtime.store.hygiene`
call :meth:`Transitions.children_ended`). Only a task's first moves are elsewhere, each
in the module named for it: inserted by :mod:`runtime.store.tasks`, leased and handed
back by :mod:`runtime.store.claims`.

Each state change is one guarded statement that also writes its ``task_events`` rows;
where fan-in has to follow (a child became terminal), the parents are locked, the
children's spend rolled up and the ready parents flipped in that same transaction. A
write from a worker whose lease was taken away matches no row, changes nothing, and is
logged.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from runtime.budget import sum_by_parent
from runtime.jsoncodec import dumps_fast
from runtime.store.database import Database
from runtime.store.policies import Policies
from runtime.store.queries import TEXT as _TEXT
from runtime.store.queries import Task
from runtime.store.rows import (
    HANDED_DOWN,
    HANDED_UP,
    TERMINAL_STATUSES,
    ChildRow,
    Finished,
    Handoff,
    JudgeOutcome,
    NotFound,
    ResolveRefused,
    RunOutcome,
    TaskRow,
    canonical_json,
)

log = logging.getLogger(__name__)

#: One delegation: ``(task_id, lease_token, children, detail)``, optionally ``+ (stamp,)``
#: (what ran: the agent's version and the prompts it rendered).
Delegation = (tuple[uuid.UUID, uuid.UUID, Sequence[ChildRow], str | None]
              | tuple[uuid.UUID, uuid.UUID, Sequence[ChildRow], str | None,
                      dict[str, Any] | None])


#: The first key of the trees' steering locks (advisory, two-int form; the second is the
#: hash of the root id): what a cancel or pause (exclusive), the model-call gate and the
#: writes that add or reopen tasks in a tree (shared) meet on.
STEER_LOCK_CLASS = 0x5354  # "ST"


class Transitions:
    """A task's status changes after its claim: outcomes of leased work, resolutions, fan-in.

    ``store.transitions``; ``policies`` is the store's
    :class:`~runtime.store.policies.Policies` (the tenancy a hand-off claims with and
    a delegation's fair time is weighed by; the require_approval holds of the children
    a delegation inserts).
    """

    def __init__(self, database: Database, policies: Policies) -> None:
        self.database = database
        self.policies = policies

    def finish_running(self, outcomes: Sequence[RunOutcome], worker: str,
                       handoff: Handoff | None = None) -> Finished:
        """Apply a batch of run outcomes in one transaction, then fan-in their parents.

        With ``handoff``, the parents made ready that the worker's next claim could take
        are leased to it in the same transaction (the hand-up: :class:`Handoff`).
        """
        return self._finish("task_finish_running", [
            {"id": o.task_id, "token": o.lease_token, "to_status": o.to_status,
             "result": o.result, "error": o.error, "delay": float(o.delay_seconds),
             "detail": o.detail, "verdict": o.verdict, "stamp": o.stamp,
             "skips_judging": o.skips_judging}
            for o in outcomes
        ], outcomes, worker, handoff)

    def finish_judging(self, outcomes: Sequence[JudgeOutcome], worker: str,
                       handoff: Handoff | None = None) -> Finished:
        """Apply a batch of verdicts in one transaction, then fan-in their parents (and hand up)."""
        return self._finish("task_finish_judging", [
            {"id": o.task_id, "token": o.lease_token, "to_status": o.to_status,
             "verdict": o.verdict, "error": o.error, "detail": o.detail}
            for o in outcomes
        ], outcomes, worker, handoff)

    def _finish(self, query: str, batch: list[dict[str, Any]],
                outcomes: Sequence[RunOutcome] | Sequence[JudgeOutcome],
                worker: str, handoff: Handoff | None = None) -> Finished:
        """One guarded batch statement (with its events), then the ended children's fan-in."""
        done = Finished()
        if not outcomes:
            return done
        got: list[TaskRow] = []
        with self.database.transaction() as conn:
            rows = conn.execute(_TEXT[query], {"batch": dumps_fast(batch),
                                               "worker": worker}).all()
            done.applied = [r.id for r in rows]
            ended = [r for r in rows if r.status in TERMINAL_STATUSES]
            # task_finish_running rolled its ended children up itself (one row version
            # each, not two) and returns what each adds to its parent.
            rolled = ([(r.parent_id, r.tokens, r.usd) for r in ended
                       if r.parent_id is not None and (r.tokens or r.usd)]
                      if query == "task_finish_running" else None)
            done.parents_ready = self.children_ended(conn, ended, worker, handoff, got,
                                                     rolled)
        if handoff is not None:
            handoff.took(got)  # committed: they are this worker's now
        self._log_stale(outcomes, done)
        return done

    def children_ended(self, conn: Connection, ended: Sequence[Any], worker: str,
                        handoff: Handoff | None = None,
                        got: list[TaskRow] | None = None,
                        rolled: Sequence[tuple[uuid.UUID, int, Any]] | None = None,
                        ) -> list[uuid.UUID]:
        """Children reached a terminal status: roll their spend up, then fan in.

        ``ended`` are rows with ``id`` and ``parent_id``; runs in the caller's transaction.
        ``rolled``: when the statement that ended them also rolled them up (marked their
        spend rolled), what each adds to its parent, ``(parent_id, tokens, usd)``: only
        added to the parents, no roll-up statement.
        """
        return self._fan_in(conn, {r.parent_id for r in ended if r.parent_id is not None},
                            worker, ended_children=[r.id for r in ended],
                            handoff=handoff, got=got, rolled=rolled)

    @staticmethod
    def roll_up(conn: Connection, child_ids: Sequence[uuid.UUID]) -> None:
        """Add terminal children's spend since their last roll-up to their locked parents.

        Budget rule 6 (:mod:`runtime.budget`): the SQL returns each child's unrolled spend,
        :func:`~runtime.budget.sum_by_parent` adds them up, one update per parent.
        """
        rolled = conn.execute(_TEXT["task_roll_up_children"], {"ids": list(child_ids)}).all()
        Transitions.add_children_spend(conn, [(r.parent_id, r.tokens, r.usd) for r in rolled])

    @staticmethod
    def add_children_spend(conn: Connection,
                           rolled: Sequence[tuple[uuid.UUID, int, Any]]) -> None:
        """Add rolled-up spend ``(parent_id, tokens, usd)`` to the (locked) parents.

        One update per parent (:func:`~runtime.budget.sum_by_parent`); budget rule 6.
        """
        if not rolled:
            return
        totals = sum_by_parent(rolled)
        ids = sorted(totals)
        conn.execute(_TEXT["task_add_children_spend"],
                     {"ids": ids, "tokens": [totals[i][0] for i in ids],
                      "usd": [totals[i][1] for i in ids]})

    def _fan_in(self, conn: Connection, parent_ids: set[uuid.UUID], worker: str,
                ended_children: Sequence[uuid.UUID] = (), handoff: Handoff | None = None,
                got: list[TaskRow] | None = None,
                rolled: Sequence[tuple[uuid.UUID, int, Any]] | None = None,
                ) -> list[uuid.UUID]:
        """Lock the parents, roll up their ended children's spend, flip the ready ones.

        ``rolled``: the ended children's spend already rolled up (see
        :meth:`children_ended`), added to the parents without a roll-up statement.

        The parents are locked deepest first, then by id; the ready ones are handed up to
        ``handoff``'s worker if its next claim could take them, and added to ``got`` (the
        caller hands them over once committed). All in the caller's transaction: two
        transactions finishing the last two children of one parent serialise on the
        parent's lock, and the second sees the first.
        """
        if not parent_ids:
            return []
        ids = sorted(parent_ids)
        conn.execute(_TEXT["task_lock_parents"], {"ids": ids})
        if rolled is not None:
            self.add_children_spend(conn, rolled)
        elif ended_children:
            self.roll_up(conn, ended_children)
        offer = (handoff if handoff is not None and got is not None and handoff.offered()
                 and handoff.room > len(got) else None)
        rows = conn.execute(_TEXT["task_flip_ready_parents"], {
            "ids": ids, "worker": worker,
            "quiet_agents": list(offer.agents) if offer is not None else []}).all()
        ready = [r.id for r in rows]
        if offer is not None and got is not None and ready:
            self._hand_off(conn, ready, worker, offer, got, HANDED_UP)
        return ready

    def _hand_off(self, conn: Connection, ids: list[uuid.UUID], worker: str,
                  handoff: Handoff, got: list[TaskRow], note: str) -> None:
        """Lease to ``worker`` what of ``ids`` its next claim could take; announce the rest.

        ``ids`` were made claimable by this transaction, their agents' notifications held
        back (``quiet_agents``): those not taken are announced here (``task_notify_waiting``).
        """
        tenants = self.policies.tenancy.claim_params()
        result = conn.execute(_TEXT["task_claim_handed"], {
            "ids": ids, "agents": list(handoff.agents), "limit": handoff.room - len(got),
            "worker": worker, "lease_seconds": float(handoff.lease_seconds),
            "dry_tenants": tenants["bucket_tenants"], "cap_tenants": tenants["cap_tenants"],
            "claim_note": note})
        rows = TaskRow.from_rows(list(result.keys()), result.all())
        got.extend(rows)
        if len(rows) < len(ids):
            taken = {r.id for r in rows}
            conn.execute(_TEXT["task_notify_waiting"], {
                "ids": [i for i in ids if i not in taken], "agents": list(handoff.agents)})

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
    @staticmethod
    def _hold_steering(conn: Connection, task_ids: Sequence[uuid.UUID]) -> None:
        """Hold the steering locks of these tasks' trees, shared, to the transaction's end.

        Taken before any row by the writes that add tasks to a tree or reopen them
        (delegation, retry of children). A cancel takes its tree's lock exclusive, so it
        runs wholly before such a write or wholly after it: its one statement then sees
        every open task of the subtree and locks them all deepest first, then by id. It
        used to wait for a delegating parent, lock it, and find the new children in a
        later pass, after the parent; a worker finishing one of them (child, then parent)
        then deadlocked with it (tests/integration/test_cancel_lock_order.py).
        """
        conn.execute(_TEXT["tree_lock_steer_shared"],
                     {"ids": list(task_ids), "lock_class": STEER_LOCK_CLASS})

    def delegate(self, task_id: uuid.UUID, lease_token: uuid.UUID, children: Sequence[ChildRow],
                 worker: str, detail: str | None = None,
                 stamp: dict[str, Any] | None = None,
                 handoff: Handoff | None = None) -> tuple[bool, int]:
        """Move a leased running parent to ``waiting`` and insert its children atomically.

        Returns ``(applied, inserted)``: ``applied`` is False when the lease was gone
        (nothing changed); ``inserted`` counts children that did not exist yet. ``stamp``
        is what ran (:attr:`~runtime.store.rows.RunOutcome.stamp`); ``handoff``: see
        :meth:`delegate_many`.
        """
        return self.delegate_many([(task_id, lease_token, children, detail, stamp)], worker,
                                  handoff)[0]

    def delegate_many(self, delegations: Sequence[Delegation], worker: str,
                      handoff: Handoff | None = None) -> list[tuple[bool, int]]:
        """Several delegations ``(task_id, lease_token, children, detail[, stamp])``.

        Each parent is guarded by its lease token as in :meth:`delegate`; the parents
        that moved and did not insert every child they listed are then checked for
        fan-in (a re-run parent may find every child already finished), in the same
        transaction. With ``handoff``, the new children
        the worker's next claim could take are leased to it in that transaction too (the
        hand-down: :class:`Handoff`). Returns ``(applied, inserted)`` per delegation, in
        order. A payload the database refuses fails the whole call: retry them one by one.
        """
        if not delegations:
            return []
        batch: list[dict[str, Any]] = [
            {"id": str(task_id), "token": str(token),
             "detail": detail or f"delegated to {len(children)} children",
             "children": [
                 {"id": str(uuid.uuid4()), "to_agent": c.to_agent, "type": c.type,
                  "payload": c.payload, "success_criteria": c.success_criteria,
                  "kill_criteria": c.kill_criteria, "budget_tokens": c.budget_tokens,
                  "budget_seconds": c.budget_seconds, "budget_usd": str(c.budget_usd),
                  "priority": c.priority, "key": c.key, "n": n}
                 for n, c in enumerate(children, start=1)],
             "stamp": rest[0] if rest else None}
            for task_id, token, children, detail, *rest in delegations
        ]
        offer = handoff if handoff is not None and handoff.offered() else None
        got: list[TaskRow] = []
        with self.database.transaction() as conn:
            self._hold_steering(conn, [d[0] for d in delegations])
            moved = {row.id: int(row.inserted) for row in conn.execute(
                _TEXT["task_delegate_running_many"],
                {"batch": canonical_json(batch), "worker": worker,
                 **self.policies.approval_params(),
                 **self.policies.tenancy.delegation_params(),
                 "quiet_agents": list(offer.agents) if offer is not None else []})}
            kids = [uuid.UUID(c["id"]) for d in batch if uuid.UUID(d["id"]) in moved
                    for c in d["children"]]
            if offer is not None and kids:
                self._hand_off(conn, kids, worker, offer, got, HANDED_DOWN)
            # Only a parent that found children already there (it ran before) or listed
            # none can have them all finished: one that inserted every child cannot.
            listed = {uuid.UUID(d["id"]): len(d["children"]) for d in batch}
            self._fan_in(conn, {p for p, n in moved.items() if n < listed[p] or not n}, worker,
                         handoff=handoff, got=got)
        if handoff is not None:
            handoff.took(got)  # committed: they are this worker's now
        ids = [d[0] for d in delegations]
        for task_id in ids:
            if task_id not in moved:
                log.warning("late delegation ignored: lease gone",
                            extra={"task_id": str(task_id)})
        return [(task_id in moved, moved.get(task_id, 0)) for task_id in ids]

    def retry_children(self, task_id: uuid.UUID, lease_token: uuid.UUID,
                       child_ids: Sequence[uuid.UUID], worker: str,
                       reassign_to: str | None = None, detail: str | None = None) -> int:
        """From ``aggregate``: send finished children back to pending and wait again.

        Returns how many children were re-queued (0 when the parent's lease was gone).
        """
        what = f"reassigned to {reassign_to}" if reassign_to else "retried"
        with self.database.transaction() as conn:
            self._hold_steering(conn, [task_id])
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
        with self.database.transaction() as conn:
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
            rows = self.database.rows(conn, "task_resolve_escalated", id=task_id,
                                      to_status=to_status, reassign_to=reassign_to,
                                      actor=actor, detail=detail,
                                      error=error if to_status == "failed" else None)
            if not rows:
                raise ResolveRefused(f"task {task_id} changed while resolving; try again")
            if to_status != "pending" and task.parent_id is not None:
                self.children_ended(conn, [task], actor)
            fresh = self.database.rows(conn, "task_get", id=task_id)[0]
        return fresh
