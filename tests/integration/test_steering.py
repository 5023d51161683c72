"""Steering a tree through the store: cancel, pause/resume, answers, approvals (issue 22).

Real PostgreSQL; each case says which writer comes first and checks the fence holds:
one terminal event per task, fan-in in the same transaction, late writes refused.
"""

from __future__ import annotations

import threading
import uuid
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from runtime.store.queries import QUERIES
from runtime.store.rows import ChildRow, ModelCharge, NotFound, RunOutcome, TaskRow
from runtime.store.steering import SteeringRefused
from runtime.store.store import Store
from tests.factories import (
    child_rows,
    events,
    expire_leases,
    parent_with_children,
    submit,
    terminal_event_counts,
)


def _grow(store: Store) -> tuple[uuid.UUID, list[uuid.UUID], list[uuid.UUID]]:
    """root waiting -> 2 mids waiting -> 2 leaves each pending; returns (root, mids, leaves)."""
    root, mids = parent_with_children(store, 2, agent="mid")
    claimed = store.claims.claim(["mid"], 2, "w-mid", 30)
    leaves: list[uuid.UUID] = []
    for row in claimed:
        applied, _ = store.transitions.delegate(row.id, row.lease,
                                                child_rows(2, prefix=str(row.id)[:4]), "w-mid")
        assert applied
        leaves += [c["id"] for c in store.reads.children(row.id)]
    return root["id"], [m["id"] for m in mids], leaves


def _statuses(store: Store, root_id: uuid.UUID) -> dict[uuid.UUID, str]:
    return {t["id"]: t["status"] for t in store.reads.tree_rows(root_id)}


def _charge(row, usd: str = "0.5") -> ModelCharge:
    return ModelCharge(task_id=row.id, lease_token=row.lease, attempt=1, call_index=0,
                       backend="offline", route="local", route_reason="test", model="m",
                       prompt="p", response="r", prompt_tokens=10, completion_tokens=5,
                       duration_seconds=0.1, cost_usd=Decimal(usd))


# ---------------------------------------------------------------- cancel
def test_cancel_ends_every_open_task_of_the_tree_with_one_event_each(store: Store) -> None:
    root, mids, leaves = _grow(store)
    running = store.claims.claim(["echo"], 1, "w-leaf", 30)
    out = store.steering.cancel(root, actor="alice", note="bad goal")
    assert out.cancelled == 1 + 2 + 4
    assert set(_statuses(store, root).values()) == {"cancelled"}
    counts = terminal_event_counts(store)
    assert all(counts[i] == 1 for i in [root, *mids, *leaves])
    ev = store.reads.events(root)[-1]
    assert ev["worker"] == "alice" and "bad goal" in ev["detail"]
    # The leaf a worker holds lost its lease: its late finish matches nothing.
    late = store.transitions.finish_running([RunOutcome(running[0].id, running[0].lease, "judging",
                                                        result={"text": "x"})], "w-leaf")
    assert late.applied == [] and late.stale == [running[0].id]
    assert store.reads.get(running[0].id)["status"] == "cancelled"
    assert store.reads.get(running[0].id)["lease_token"] is None


def test_cancel_twice_adds_no_event_and_says_so(store: Store) -> None:
    root, _, _ = _grow(store)
    store.steering.cancel(root)
    n = len(store.reads.events(root))
    again = store.steering.cancel(root)
    assert again.cancelled == 0 and "already cancelled" in again.message
    assert len(store.reads.events(root)) == n


def test_cancel_of_a_finished_task_is_a_no_op_that_says_so(store: Store) -> None:
    task = submit(store)
    row = store.claims.claim(["echo"], 1, "w", 30)[0]
    store.transitions.finish_running([RunOutcome(row.id, row.lease, "failed", error="x")], "w")
    out = store.steering.cancel(task["id"])
    assert out.cancelled == 0 and "already finished (failed)" in out.message
    assert store.reads.get(task["id"])["status"] == "failed"


def test_cancel_of_an_unknown_task_raises_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        store.steering.cancel(uuid.uuid4())


def test_cancel_of_a_subtree_fans_in_its_parent_as_a_failed_child(store: Store) -> None:
    root, kids = parent_with_children(store, 2)
    rows = store.claims.claim(["echo"], 2, "w", 30)
    first = next(r for r in rows if r.id == kids[0]["id"])
    second = next(r for r in rows if r.id == kids[1]["id"])
    store.spend.charge_many([_charge(second, "0.25")])
    store.transitions.finish_running([RunOutcome(first.id, first.lease, "failed", error="x")], "w")
    out = store.steering.cancel(second.id, note="enough")
    # The parent flipped in the cancel's own transaction, and the spend rolled up.
    assert out.parents_ready == (root["id"],)
    parent = store.reads.get(root["id"])
    assert parent["status"] == "ready_to_aggregate"
    assert parent["spent_usd"] == Decimal("0.25")
    assert events(store, root["id"])[-1] == ("waiting", "ready_to_aggregate")


def test_cancel_rolls_spend_up_through_every_level(store: Store) -> None:
    root, _, _ = _grow(store)
    leaf_rows = store.claims.claim(["echo"], 4, "w", 30)
    store.spend.charge_many([_charge(r, "0.5") for r in leaf_rows])
    store.steering.cancel(root)
    assert store.reads.get(root)["spent_usd"] == Decimal("2.0")


def test_a_call_answered_before_the_cancel_is_charged_after_it_and_rolled_up(
        store: Store) -> None:
    root, _, _ = _grow(store)
    row = store.claims.claim(["echo"], 1, "w", 30)[0]
    store.steering.cancel(root)
    # The reply came back before the worker stopped; its charge lands after the cancel.
    assert store.spend.charge_many([_charge(row, "0.5")]) == [True]
    assert store.reads.get(row.id)["spent_usd"] == Decimal("0.5")
    # ... and reaches every (cancelled) ancestor, up to the root.
    assert store.reads.get(root)["spent_usd"] == Decimal("0.5")
    assert len(store.reads.model_calls(row.id)) == 1
    # Every other fenced write of that worker is still refused.
    late = store.transitions.finish_running([RunOutcome(row.id, row.lease, "judging",
                                                        result={})], "w")
    assert late.applied == []


def test_a_late_charge_of_a_task_that_was_not_cancelled_is_refused(store: Store) -> None:
    submit(store)
    row = store.claims.claim(["echo"], 1, "w", 30)[0]
    store.transitions.finish_running([RunOutcome(row.id, row.lease, "failed", error="x")], "w")
    assert store.spend.charge_many([_charge(row)]) == [False]


def test_a_cancel_racing_a_workers_finish_leaves_one_terminal_event(store: Store) -> None:
    for _ in range(10):
        root, kids = parent_with_children(store, 4)
        rows = store.claims.claim(["echo"], 4, "w", 30)
        barrier = threading.Barrier(2)

        def finish(rows: list = rows, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            store.transitions.finish_running([RunOutcome(r.id, r.lease, "failed", error="x")
                                              for r in rows], "w")

        t = threading.Thread(target=finish)
        t.start()
        barrier.wait()
        store.steering.cancel(root["id"])
        t.join()
        counts = terminal_event_counts(store)
        assert all(counts[k["id"]] == 1 for k in kids)
        assert counts[root["id"]] == 1
        assert store.reads.get(root["id"])["status"] == "cancelled"


def test_a_batch_finish_waits_for_its_rows_in_a_cancels_order(store: Store) -> None:
    """A finish of siblings locks them by id (a cancel's order), whatever the batch's order.

    Were it to lock the second sibling and then wait for the first, a cancel holding the
    first (it locks by depth, then id) and waiting for the second would deadlock with it.
    """
    parent_with_children(store, 2)
    first, second = sorted(store.claims.claim(["echo"], 2, "w", 30), key=lambda r: r.id)
    with store.engine.connect() as holder:
        tx = holder.begin()
        holder.execute(sa.text("SELECT 1 FROM tasks WHERE id = :id FOR UPDATE"),
                       {"id": first.id})
        t = threading.Thread(target=store.transitions.finish_running, args=(
            [RunOutcome(r.id, r.lease, "failed", error="x") for r in (second, first)], "w"))
        t.start()
        t.join(0.3)
        assert t.is_alive()  # it waits for the first sibling...
        with store.engine.connect() as probe:  # ...holding nothing of its batch
            probe.execute(sa.text("SELECT 1 FROM tasks WHERE id = :id FOR UPDATE NOWAIT"),
                          {"id": second.id})
            probe.rollback()
        tx.rollback()
    t.join(10)
    assert {store.reads.get(r.id)["status"] for r in (first, second)} == {"failed"}


def _late_finish(store: Store, late: TaskRow) -> tuple[threading.Thread, dict[str, Any]]:
    """A late worker's finish of ``late`` (failed), started in a thread; ``done["out"]``."""
    done: dict[str, Any] = {}
    t = threading.Thread(target=lambda: done.update(out=store.transitions.finish_running(
        [RunOutcome(late.id, late.lease, "failed", error="late")], "w-late")))
    t.start()
    return t, done


def test_a_late_workers_batch_locks_nothing_another_worker_now_holds(store: Store) -> None:
    """A batch whose lease was taken over neither waits on the new owner's row nor writes it."""
    parent_with_children(store, 1)
    late = store.claims.claim(["echo"], 1, "w-late", 30)[0]
    expire_leases(store)
    assert store.hygiene.reap(max_delivery=5).released == 1  # the task goes back to the queue
    owner = store.claims.claim(["echo"], 1, "w-owner", 30)[0]
    assert owner.id == late.id and owner.lease != late.lease
    with store.engine.connect() as holder:  # the new owner is writing the row right now
        tx = holder.begin()
        holder.execute(sa.text("SELECT 1 FROM tasks WHERE id = :id FOR UPDATE"),
                       {"id": owner.id})
        t, done = _late_finish(store, late)
        t.join(10)
        alive = t.is_alive()
        tx.rollback()
    t.join(10)
    assert not alive  # it did not wait for the owner's lock
    assert done["out"].applied == []
    assert store.reads.get(owner.id)["status"] == "running"
    assert store.reads.get(owner.id)["lease_token"] == owner.lease


def test_a_batch_that_waited_while_its_lease_changed_hands_writes_nothing(store: Store) -> None:
    """The guard sits in the lock: re-checked on the row's latest version after the wait.

    The batch's statement starts while its token still matches, waits for the row, and
    the transaction it waited for gives the row a new lease. Its UPDATE joins on the key
    alone, so only the lock's re-check of the token keeps the late write out.
    """
    parent_with_children(store, 1)
    late = store.claims.claim(["echo"], 1, "w-late", 30)[0]
    with store.engine.connect() as holder:  # the reaper and a new claim, in one transaction
        tx = holder.begin()
        holder.execute(sa.text("UPDATE tasks SET lease_token = gen_random_uuid(), "
                               "lease_owner = 'w-owner' WHERE id = :id"), {"id": late.id})
        t, done = _late_finish(store, late)
        t.join(1.0)
        waited = t.is_alive()
        tx.commit()
    t.join(10)
    assert waited  # it found the row under its token, then waited for the lock
    assert done["out"].applied == []
    row = store.reads.get(late.id)
    assert row["status"] == "running" and row["lease_owner"] == "w-owner"
    assert [e for e in events(store, late.id) if e[1] == "failed"] == []


def test_cancel_reaches_children_of_a_delegation_that_committed_meanwhile(store: Store) -> None:
    root = submit(store, "fanout")
    row = store.claims.claim(["fanout"], 1, "w", 30)[0]
    # A delegation holds the parent's row when the cancel starts: the cancel waits for
    # it, then (in a later pass) finds the children its first snapshot could not see.
    with store.engine.connect() as conn:
        tx = conn.begin()
        conn.execute(sa.text("SELECT 1 FROM tasks WHERE id = :id FOR UPDATE"), {"id": row.id})
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(out=store.steering.cancel(root["id"])))
        t.start()
        t.join(0.3)
        conn.execute(sa.text(
            "UPDATE tasks SET status = 'waiting', lease_token = NULL, lease_owner = NULL, "
            "lease_expires_at = NULL WHERE id = :id"), {"id": row.id})
        conn.execute(sa.text(
            "INSERT INTO tasks (parent_id, root_id, to_agent, type, payload, depth) "
            "VALUES (:id, :id, 'echo', 'task', '{}', 1)"), {"id": row.id})
        tx.commit()
    t.join(10)
    assert result["out"].cancelled == 2
    assert set(_statuses(store, root["id"]).values()) == {"cancelled"}


# ---------------------------------------------------------------- pause
def test_a_paused_tree_is_not_claimed_until_resumed(store: Store) -> None:
    root, kids = parent_with_children(store, 3)
    other = submit(store)
    assert store.steering.pause(root["id"], actor="bob").changed
    again = store.steering.pause(root["id"])
    assert not again.changed and "already paused" in again.message
    claimed = store.claims.claim(["echo"], 10, "w", 30)
    assert [r.id for r in claimed] == [other["id"]]
    assert store.steering.pause_of(root["id"])["paused_by"] == "bob"
    assert store.steering.resume(root["id"]).changed
    assert not store.steering.resume(root["id"]).changed
    assert {r.id for r in store.claims.claim(["echo"], 10, "w", 30)} == {k["id"] for k in kids}


def test_pause_of_a_child_or_unknown_task_is_refused(store: Store) -> None:
    _, kids = parent_with_children(store, 1)
    with pytest.raises(SteeringRefused, match="not a root"):
        store.steering.pause(kids[0]["id"])
    with pytest.raises(NotFound):
        store.steering.pause(uuid.uuid4())


def test_pause_gates_model_calls_and_keeps_leases(store: Store) -> None:
    root, _ = parent_with_children(store, 2)
    rows = store.claims.claim(["echo"], 2, "w", 30)
    store.steering.pause(root["id"])
    gate = store.steering.gate_calls([r.id for r in rows])
    assert all(g.paused and not g.stopped for g in gate.values())
    assert store.claims.heartbeat([r.lease for r in rows], 30) == {r.lease for r in rows}
    store.steering.resume(root["id"])
    assert not any(g.paused for g in store.steering.gate_calls([r.id for r in rows]).values())


def test_resume_moves_running_deadlines_on_by_the_pause(store: Store) -> None:
    root, _ = parent_with_children(store, 1)
    row = store.claims.claim(["echo"], 1, "w", 30)[0]
    store.steering.pause(root["id"])
    with store.database.transaction() as conn:
        conn.execute(sa.text("UPDATE tree_pauses SET paused_at = now() - interval '1 hour'"))
    store.steering.resume(root["id"])
    assert store.reads.get(row.id)["deadline_at"] > row.deadline_at + dt_hours(0.99)


def dt_hours(h: float):
    import datetime as dt

    return dt.timedelta(hours=h)


def test_claim_keeps_the_partial_index_with_a_paused_tree(store: Store) -> None:
    with store.database.transaction() as conn:
        conn.execute(sa.text(
            "INSERT INTO tasks (to_agent, type, payload, status, completed_at) "
            "SELECT 'echo', 'task', '{}', 'done', now() FROM generate_series(1, 20000)"))
        conn.execute(sa.text("ANALYZE tasks"))
    store.steering.pause(submit(store)["id"])
    submit(store)
    with store.engine.connect() as conn:
        plan = "\n".join(r[0] for r in conn.execute(
            sa.text("EXPLAIN " + QUERIES["task_claim_available"]),
            {"agents": ["echo"], "limit": 10, "worker": "w", "lease_seconds": 30.0,
             "cap_tenants": [], "caps": [], "dry_tenants": []}))
        conn.rollback()
    assert "ix_tasks_claimable" in plan, plan


# ---------------------------------------------------------------- questions
def _ask(store: Store, payload: dict, budget_seconds: int = 60) -> tuple[uuid.UUID, uuid.UUID]:
    root = submit(store, "fanout")
    row = store.claims.claim(["fanout"], 1, "w", 30)[0]
    store.transitions.delegate(row.id, row.lease, [ChildRow("human", "task", payload, "q", 0,
                                                            budget_seconds, Decimal(0))], "w")
    return root["id"], store.reads.children(root["id"])[0]["id"]


def test_a_question_is_never_claimed_and_its_answer_fans_in(store: Store) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"]}
    root, q = _ask(store, {"question": "ship it?", "answer_schema": schema})
    assert store.claims.claim(["human", "echo"], 10, "w", 30) == []
    inbox = store.steering.inbox()
    assert [(i["kind"], i["id"], i["from_agent"]) for i in inbox] == [("question", q, "fanout")]
    with pytest.raises(SteeringRefused, match="answer_schema"):
        store.steering.answer(q, {"ok": "yes"})
    assert store.reads.get(q)["status"] == "pending"
    out = store.steering.answer(q, {"ok": True}, actor="carol")
    assert out.parents_ready == (root,)
    task = store.reads.get(q)
    assert task["status"] == "done" and task["result"] == {"ok": True}
    assert store.reads.events(q)[-1]["worker"] == "carol"
    assert store.reads.get(root)["status"] == "ready_to_aggregate"
    with pytest.raises(SteeringRefused, match="no longer an open question"):
        store.steering.answer(q, {"ok": False})


def test_an_answer_must_be_one_of_the_choices(store: Store) -> None:
    _, q = _ask(store, {"question": "colour?", "choices": ["red", "blue"]})
    with pytest.raises(SteeringRefused, match="not one of the choices"):
        store.steering.answer(q, "green")
    store.steering.answer(q, {"choice": "blue"})
    assert store.reads.get(q)["result"] == {"choice": "blue"}


def test_an_answer_racing_a_cancel_changes_nothing_when_second(store: Store) -> None:
    root, q = _ask(store, {"question": "go?"})
    store.steering.cancel(root)
    with pytest.raises(SteeringRefused, match="cancelled"):
        store.steering.answer(q, {"go": True})
    assert terminal_event_counts(store)[q] == 1


def test_a_question_past_its_deadline_fails(store: Store) -> None:
    root, q = _ask(store, {"question": "late?"}, budget_seconds=1)
    with store.database.transaction() as conn:
        conn.execute(sa.text("UPDATE tasks SET created_at = now() - interval '1 minute' "
                             "WHERE id = :id"), {"id": q})
    assert store.steering.fail_unanswered() == [q]
    task = store.reads.get(q)
    assert task["status"] == "failed" and task["error"] == "no answer: deadline"
    assert store.reads.get(root)["status"] == "ready_to_aggregate"


# ---------------------------------------------------------------- approvals
def test_require_approval_holds_a_child_until_approved_once(store: Store) -> None:
    store.policies.approval_agents = ("echo",)
    _, kids = parent_with_children(store, 2)
    assert {k["status"] for k in kids} == {"awaiting_approval"}
    assert store.claims.claim(["echo"], 10, "w", 30) == []
    assert {i["kind"] for i in store.steering.inbox()} == {"approval"}
    assert store.steering.approve(kids[0]["id"], actor="dan").changed
    again = store.steering.approve(kids[0]["id"])
    assert not again.changed and "not awaiting approval" in again.message
    assert [r.id for r in store.claims.claim(["echo"], 10, "w", 30)] == [kids[0]["id"]]
    with pytest.raises(SteeringRefused, match="note"):
        store.steering.reject(kids[1]["id"], note="")
    out = store.steering.reject(kids[1]["id"], note="too costly", actor="dan")
    assert out.changed
    task = store.reads.get(kids[1]["id"])
    assert task["status"] == "failed" and "too costly" in task["error"]


def test_require_approval_holds_a_root_submitted_to_a_listed_agent(store: Store) -> None:
    store.policies.approval_agents = ("echo",)
    held, free = submit(store, "echo"), submit(store, "fanout")
    assert held["status"] == "awaiting_approval" and free["status"] == "pending"
    assert events(store, held["id"]) == [(None, "awaiting_approval")]
    assert "held for approval" in store.reads.events(held["id"])[0]["detail"]
    assert [r.id for r in store.claims.claim(["echo", "fanout"], 10, "w", 30)] == [free["id"]]
    assert [i["id"] for i in store.steering.inbox()] == [held["id"]]
    assert store.steering.approve(held["id"], actor="dan").changed
    assert [r.id for r in store.claims.claim(["echo"], 10, "w", 30)] == [held["id"]]
    assert events(store, held["id"])[-2:] == [("awaiting_approval", "pending"),
                                              ("pending", "running")]


def test_require_approval_holds_bulk_roots_and_never_a_question(store: Store) -> None:
    store.policies.approval_agents = ("echo", "human")
    assert store.tasks.submit_many("echo", "task", [{"goal": "a"}, {"goal": "b"}]) == 2
    assert store.claims.claim(["echo"], 10, "w", 30) == []
    assert [i["kind"] for i in store.steering.inbox()] == ["approval", "approval"]
    question = submit(store, "human")  # a question to a person waits for its answer only
    assert question["status"] == "pending"


def test_require_approval_above_a_tree_spend(store: Store) -> None:
    store.policies.approve_above_usd = Decimal("0.015")
    root = submit(store, "fanout")
    row = store.claims.claim(["fanout"], 1, "w", 30)[0]
    store.spend.charge_many([_charge(row, "0.01")])
    store.transitions.delegate(row.id, row.lease, child_rows(1), "w")   # 0.01 + 0.01 > 0.015
    assert store.reads.children(root["id"])[0]["status"] == "awaiting_approval"


def test_rejecting_the_last_child_fans_in_its_parent(store: Store) -> None:
    store.policies.approval_agents = ("echo",)
    root, kids = parent_with_children(store, 1)
    out = store.steering.reject(kids[0]["id"], note="no")
    assert out.parents_ready == (root["id"],)


def test_the_watchdog_spares_a_paused_tree(store: Store) -> None:
    from tests.factories import backdate_claims

    root, _ = parent_with_children(store, 1)
    row = store.claims.claim(["echo"], 1, "w", 30)[0]
    store.steering.pause(root["id"])
    backdate_claims(store, 3600)
    assert store.hygiene.time_out().failed == 0
    store.steering.resume(root["id"])
    assert store.reads.get(row.id)["status"] == "running"


def test_a_cancel_waits_for_a_gate_read_that_holds_its_tree(store: Store) -> None:
    root, _ = parent_with_children(store, 1)
    row = store.claims.claim(["echo"], 1, "w", 30)[0]
    states, release = store.steering.gate_calls_held([row.id])
    assert states[row.id].status == "running"
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(out=store.steering.cancel(root["id"])))
    t.start()
    t.join(0.5)
    assert t.is_alive()            # the calls that read let through start first
    assert store.reads.get(row.id)["status"] == "running"
    release()
    t.join(10)
    assert done["out"].cancelled == 2
    again, release = store.steering.gate_calls_held([row.id])
    release()
    assert again[row.id].status == "cancelled"
