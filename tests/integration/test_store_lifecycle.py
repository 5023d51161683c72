"""The lifecycle statements against a real PostgreSQL: claims, leases, fencing, fan-in."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest
import sqlalchemy as sa

from runtime.config import RetrySettings
from runtime.engine.charges import ChargeWriter
from runtime.engine.maintenance import Maintenance, Reaper, Sweeper, Watchdog
from runtime.store.rows import (
    IdempotencyConflict,
    JudgeOutcome,
    ModelCharge,
    NewTask,
    ResolveRefused,
    RunOutcome,
    TaskRow,
)
from runtime.store.store import Store
from tests.factories import (
    backdate_claims,
    child_rows,
    events,
    expire_leases,
    parent_with_children,
    submit,
    terminal_event_counts,
)


def test_many_threads_claiming_at_once_never_share_a_task(store: Store) -> None:
    store.tasks.submit_many("echo", "task", [{"goal": str(i)} for i in range(400)])
    claimed: list[uuid.UUID] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def claimer(n: int) -> None:
        barrier.wait()
        while True:
            rows = store.claims.claim(["echo"], 7, f"w{n}", 30)
            if not rows:
                return
            with lock:
                claimed.extend(r["id"] for r in rows)

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(claimed) == 400
    assert len(set(claimed)) == 400


def test_claim_orders_by_priority_then_fair_time(store: Store) -> None:
    late_urgent = None
    first = submit(store, priority=5)
    second = submit(store, priority=5)
    late_urgent = submit(store, priority=1)
    order = [r["id"] for r in store.claims.claim(["echo"], 3, "w", 30)]
    assert order == [late_urgent["id"], first["id"], second["id"]]


def test_claim_skips_tasks_whose_available_at_is_in_the_future(store: Store) -> None:
    task = submit(store)
    with store.database.transaction() as conn:
        conn.execute(sa.text("UPDATE tasks SET available_at = now() + interval '1 hour'"))
    assert store.claims.claim(["echo"], 10, "w", 30) == []
    with store.database.transaction() as conn:
        conn.execute(sa.text("UPDATE tasks SET available_at = now()"))
    assert [r["id"] for r in store.claims.claim(["echo"], 10, "w", 30)] == [task["id"]]


def test_claim_only_takes_the_agents_asked_for(store: Store) -> None:
    submit(store, agent="echo")
    other = submit(store, agent="other")
    rows = store.claims.claim(["other", "nobody"], 10, "w", 30)
    assert [r["id"] for r in rows] == [other["id"]]


def test_claim_skips_rows_locked_by_another_worker(store: Store) -> None:
    locked = submit(store)
    free = submit(store)
    with store.engine.connect() as other:
        other.execute(sa.text("SELECT 1 FROM tasks WHERE id = :id FOR UPDATE"),
                      {"id": locked["id"]})
        rows = store.claims.claim(["echo"], 10, "w", 30)
        other.rollback()
    assert [r["id"] for r in rows] == [free["id"]]


def test_claim_writes_one_event_and_a_fresh_lease(store: Store) -> None:
    task = submit(store)
    (row,) = store.claims.claim(["echo"], 1, "w1", 30)
    assert row["status"] == "running" and row["delivery_count"] == 1
    stored = store.reads.get(task["id"])
    assert stored["lease_owner"] == "w1" and stored["lease_token"] == row["lease_token"]
    assert row["lease_token"] is not None and stored["lease_expires_at"] is not None
    # The claimed row carries the columns the engine reads (fragment_claimed_columns).
    assert row["lease_owner"] is None and row["lease_expires_at"] is None
    assert events(store, task["id"]) == [(None, "pending"), ("pending", "running")]


def test_idempotency_key_returns_the_same_task_and_refuses_a_different_request(
        store: Store) -> None:
    a, created_a = store.tasks.submit(NewTask("echo", "task", {"goal": "x"}, idempotency_key="k"))
    b, created_b = store.tasks.submit(NewTask("echo", "task", {"goal": "x"}, idempotency_key="k"))
    assert created_a and not created_b and a["id"] == b["id"]
    with pytest.raises(IdempotencyConflict, match="'k'"):
        store.tasks.submit(NewTask("echo", "task", {"goal": "y"}, idempotency_key="k"))
    assert store.reads.metrics()["by_status"] == {"pending": 1}


def test_reaper_releases_a_lease_that_expired_ten_minutes_ago(store: Store) -> None:
    task = submit(store)
    store.claims.claim(["echo"], 1, "dead-worker", 30)
    expire_leases(store, minutes=10)
    reaped = Reaper(store, RetrySettings(max_delivery=3)).run_once()
    assert (reaped.released, reaped.poisoned) == (1, 0)
    row = store.reads.get(task["id"])
    assert row["status"] == "pending" and row["lease_token"] is None
    assert row["delivery_count"] == 1


def test_reaper_leaves_live_leases_alone(store: Store) -> None:
    submit(store)
    store.claims.claim(["echo"], 1, "alive", 30)
    assert Reaper(store, RetrySettings()).run_once().released == 0


def test_a_late_completion_after_reaping_changes_nothing(store: Store) -> None:
    task = submit(store)
    (first,) = store.claims.claim(["echo"], 1, "slow", 30)
    expire_leases(store)
    Reaper(store, RetrySettings()).run_once()
    (second,) = store.claims.claim(["echo"], 1, "fast", 30)
    done = store.transitions.finish_running([RunOutcome(task["id"], second["lease_token"],
                                                        "judging", result={"by": "fast"})],
                                            "fast")
    late = store.transitions.finish_running([RunOutcome(task["id"], first["lease_token"], "failed",
                                                        error="late")], "slow")
    assert done.applied == [task["id"]] and late.applied == [] and late.stale == [task["id"]]
    row = store.reads.get(task["id"])
    assert row["status"] == "judging" and row["result"] == {"by": "fast"} and row["error"] is None


@pytest.mark.parametrize("late_first", [True, False])
def test_a_batch_with_a_late_and_a_current_outcome_of_one_task_applies_the_current(
        store: Store, late_first: bool) -> None:
    # One worker lost a task (reaped) and claimed it again; the late delivery's outcome
    # and the current one's reach the database in the same batch, in either order. Only
    # the current one is applied, and its event names the current token.
    task = submit(store)
    (first,) = store.claims.claim(["echo"], 1, "w", 30)
    expire_leases(store)
    Reaper(store, RetrySettings()).run_once()
    (second,) = store.claims.claim(["echo"], 1, "w", 30)
    late = RunOutcome(task["id"], first["lease_token"], "failed", error="late")
    current = RunOutcome(task["id"], second["lease_token"], "judging", result={"by": "now"})
    done = store.transitions.finish_running([late, current] if late_first else [current, late], "w")
    assert done.applied == [task["id"]]
    row = store.reads.get(task["id"])
    assert row["status"] == "judging" and row["result"] == {"by": "now"}
    assert row["error"] is None
    last = store.reads.events(task["id"])[-1]
    assert last["to_status"] == "judging" and last["lease_token"] == second["lease_token"]


def test_a_task_delivered_max_delivery_times_becomes_poison(store: Store) -> None:
    task = submit(store)
    reaper = Reaper(store, RetrySettings(max_delivery=3))
    for _ in range(3):
        assert store.claims.claim(["echo"], 1, "crashy", 30)
        expire_leases(store)
        reaper.run_once()
    row = store.reads.get(task["id"])
    assert row["status"] == "failed"
    assert "poison" in row["error"] and "3 times" in row["error"]
    assert store.claims.claim(["echo"], 1, "w", 30) == []


def test_retry_outcome_backs_off_and_counts(store: Store) -> None:
    task = submit(store)
    (row,) = store.claims.claim(["echo"], 1, "w", 30)
    store.transitions.finish_running([RunOutcome(task["id"], row["lease_token"], "pending",
                                                 error="transient", delay_seconds=4.0)], "w")
    fresh = store.reads.get(task["id"])
    assert fresh["retry_count"] == 1 and fresh["status"] == "pending"
    with store.engine.connect() as conn:
        wait = conn.execute(sa.text("SELECT extract(epoch FROM available_at - now()) "
                                    "FROM tasks WHERE id = :id"), {"id": task["id"]}).scalar()
    assert 2.0 < float(wait) <= 4.0
    assert store.claims.claim(["echo"], 1, "w", 30) == []


def test_watchdog_times_out_a_task_and_its_late_worker_cannot_overwrite(store: Store) -> None:
    task = submit(store, budget_seconds=5)
    (row,) = store.claims.claim(["echo"], 1, "w", 30)
    assert Watchdog(store).run_once().failed == 0
    backdate_claims(store, 6)
    assert Watchdog(store).run_once().failed == 1
    late = store.transitions.finish_running([RunOutcome(task["id"], row["lease_token"], "judging",
                                                        result={"late": True})], "w")
    assert late.applied == []
    fresh = store.reads.get(task["id"])
    assert (fresh["status"], fresh["error"], fresh["result"]) == ("failed", "timeout", None)


def test_heartbeat_extends_held_leases_and_reports_lost_ones(store: Store) -> None:
    submit(store)
    submit(store)
    a, b = store.claims.claim(["echo"], 2, "w", 30)
    expire_leases(store, where=f"id = '{b['id']}'")
    Reaper(store, RetrySettings()).run_once()
    held = store.claims.heartbeat([a["lease_token"], b["lease_token"]], 60)
    assert held == {a["lease_token"]}


def test_every_transition_writes_exactly_one_event(store: Store) -> None:
    task = submit(store)
    (row,) = store.claims.claim(["echo"], 1, "w", 30)
    store.transitions.finish_running([RunOutcome(task["id"], row["lease_token"], "judging",
                                                 {"x": 1})], "w")
    (judging,) = store.claims.claim_judging(1, "j", 30)
    store.transitions.finish_judging([JudgeOutcome(task["id"], judging["lease_token"], "done",
                                                   {"passed": True})], "j")
    assert events(store, task["id"]) == [(None, "pending"), ("pending", "running"),
                                         ("running", "judging"), ("judging", "done")]


@pytest.mark.parametrize("n", [1, 100, 10_000])
def test_fan_in_flips_the_parent_when_the_last_child_finishes(store: Store, n: int) -> None:
    parent, children = parent_with_children(store, n)
    assert parent["status"] == "waiting" and len(children) == n
    claimed = []
    while rows := store.claims.claim(["echo"], 1000, "w", 30):
        claimed += rows
    assert len(claimed) == n
    last = claimed.pop()
    for i in range(0, len(claimed), 1000):
        chunk = claimed[i:i + 1000]
        store.transitions.finish_running([RunOutcome(r["id"], r["lease_token"], "failed", error="x")
                                          for r in chunk], "w")
    assert store.reads.get(parent["id"])["status"] == "waiting"
    done = store.transitions.finish_running([RunOutcome(last["id"], last["lease_token"],
                                                        "escalated", error="why")], "w")
    assert done.parents_ready == [parent["id"]]
    assert store.reads.get(parent["id"])["status"] == "ready_to_aggregate"
    (agg,) = store.claims.claim(["fanout"], 1, "w", 30)
    assert agg["phase"] == "aggregate" and agg["claimed_from"] == "ready_to_aggregate"


def test_two_workers_finishing_the_last_two_children_at_once_flip_the_parent(
        store: Store) -> None:
    for i in range(20):
        parent, _ = parent_with_children(store, 2, parent_agent=f"fanout{i}")
        a, b = store.claims.claim(["echo"], 2, "w", 30)
        barrier = threading.Barrier(2)

        def finish(row: dict, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            store.transitions.finish_running([RunOutcome(row["id"], row["lease_token"], "failed",
                                                         error="x")], "w")

        threads = [threading.Thread(target=finish, args=(r,)) for r in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.reads.get(parent["id"])["status"] == "ready_to_aggregate"


def test_sweeper_is_the_safety_net_for_a_missed_flip(store: Store) -> None:
    parent, _children = parent_with_children(store, 3)
    with store.database.transaction() as conn:  # children finished by hand: no flip ran
        conn.execute(sa.text("UPDATE tasks SET status = 'done' WHERE parent_id = :p"),
                     {"p": parent["id"]})
    assert store.reads.get(parent["id"])["status"] == "waiting"
    swept = Sweeper(store).run_once()
    assert swept.ready == 1 and swept.ids == (parent["id"],)
    assert Sweeper(store).run_once().ready == 0
    assert events(store, parent["id"])[-1] == ("waiting", "ready_to_aggregate")


def test_a_parent_rerun_after_a_crash_does_not_duplicate_children(store: Store) -> None:
    root = submit(store, "fanout")
    (first,) = store.claims.claim(["fanout"], 1, "w1", 30)
    # The first delivery delegated; then suppose the parent is retried by hand and runs again.
    store.transitions.delegate(root["id"], first["lease_token"], child_rows(3), "w1")
    with store.database.transaction() as conn:
        conn.execute(sa.text("UPDATE tasks SET status = 'pending', phase = 'run' "
                             "WHERE id = :id"), {"id": root["id"]})
    (second,) = store.claims.claim(["fanout"], 1, "w2", 30)
    applied, inserted = store.transitions.delegate(
        root["id"], second["lease_token"], child_rows(3) + child_rows(1, prefix="extra"), "w2")
    assert applied and inserted == 1
    keys = Counter(c["idempotency_key"] for c in store.reads.children(root["id"]))
    assert keys == {"c0": 1, "c1": 1, "c2": 1, "extra0": 1}


def test_delegation_from_a_lost_lease_writes_nothing(store: Store) -> None:
    root = submit(store, "fanout")
    (row,) = store.claims.claim(["fanout"], 1, "w1", 30)
    expire_leases(store)
    Reaper(store, RetrySettings()).run_once()
    applied, inserted = store.transitions.delegate(root["id"], row["lease_token"], child_rows(2),
                                                   "w1")
    assert (applied, inserted) == (False, 0)
    assert store.reads.children(root["id"]) == []


def test_resolve_refuses_a_task_that_is_not_escalated(store: Store) -> None:
    task = submit(store)
    with pytest.raises(ResolveRefused, match="not escalated"):
        store.transitions.resolve(task["id"], "done")


def test_resolve_refuses_to_retry_a_child_whose_parent_already_aggregated(store: Store) -> None:
    _parent, _children = parent_with_children(store, 1)
    (child,) = store.claims.claim(["echo"], 1, "w", 30)
    store.transitions.finish_running([RunOutcome(child["id"], child["lease_token"], "escalated",
                                                 error="needs a person")], "w")
    (agg,) = store.claims.claim(["fanout"], 1, "w", 30)
    store.transitions.finish_running([RunOutcome(agg["id"], agg["lease_token"], "judging",
                                                 {"ok": 1})], "w")
    with pytest.raises(ResolveRefused, match="already aggregated"):
        store.transitions.resolve(child["id"], "retry")
    assert store.reads.get(child["id"])["status"] == "escalated"


def test_resolving_an_escalated_child_retry_then_done_flips_its_parent(store: Store) -> None:
    parent, _ = parent_with_children(store, 1)
    (child,) = store.claims.claim(["echo"], 1, "w", 30)
    store.transitions.finish_running([RunOutcome(child["id"], child["lease_token"], "escalated",
                                                 error="why")], "w")
    assert store.reads.get(parent["id"])["status"] == "ready_to_aggregate"
    retried = store.transitions.resolve(child["id"], "retry", note="try again")
    assert retried["status"] == "pending"
    assert store.reads.get(parent["id"])["status"] == "waiting"
    (again,) = store.claims.claim(["echo"], 1, "w", 30)
    store.transitions.finish_running([RunOutcome(again["id"], again["lease_token"], "escalated",
                                                 error="still")], "w")
    store.transitions.resolve(child["id"], "done", note="checked by hand")
    assert store.reads.get(parent["id"])["status"] == "ready_to_aggregate"
    history = store.reads.events(child["id"])
    assert "note: checked by hand" in history[-1]["detail"]


def test_release_on_shutdown_returns_tasks_to_the_queue(store: Store) -> None:
    task = submit(store)
    (row,) = store.claims.claim(["echo"], 1, "w", 30)
    assert store.claims.release([row["lease_token"]], "w") == 1
    fresh = store.reads.get(task["id"])
    assert fresh["status"] == "pending" and fresh["delivery_count"] == 0


def test_exactly_one_terminal_transition_per_task_after_a_normal_run(store: Store) -> None:
    ids = [submit(store)["id"] for _ in range(5)]
    rows = store.claims.claim(["echo"], 5, "w", 30)
    store.transitions.finish_running([RunOutcome(r["id"], r["lease_token"], "failed", error="x")
                                      for r in rows], "w")
    store.transitions.finish_running([RunOutcome(r["id"], r["lease_token"], "failed", error="again")
                                      for r in rows], "w")
    counts = terminal_event_counts(store)
    assert all(counts[i] == 1 for i in ids)


def test_claim_uses_the_partial_index_with_many_finished_rows(store: Store) -> None:
    with store.database.transaction() as conn:
        conn.execute(sa.text(
            "INSERT INTO tasks (to_agent, type, payload, status, completed_at) "
            "SELECT 'echo', 'task', '{}', 'done', now() FROM generate_series(1, 20000)"))
        conn.execute(sa.text("ANALYZE tasks"))
    submit(store)
    from runtime.store.queries import QUERIES

    sql = QUERIES["task_claim_available"]
    with store.engine.connect() as conn:
        plan = "\n".join(r[0] for r in conn.execute(
            sa.text("EXPLAIN " + sql),
            {"agents": ["echo"], "limit": 10, "worker": "w", "lease_seconds": 30.0,
             "cap_tenants": [], "caps": [], "dry_tenants": []}))
        conn.rollback()
    assert "ix_tasks_claimable" in plan, plan


def test_sweep_uses_the_waiting_index(store: Store) -> None:
    with store.database.transaction() as conn:
        conn.execute(sa.text(
            "INSERT INTO tasks (to_agent, type, payload, status, completed_at) "
            "SELECT 'echo', 'task', '{}', 'done', now() FROM generate_series(1, 20000)"))
        conn.execute(sa.text("ANALYZE tasks"))
    parent_with_children(store, 2)
    from runtime.store.queries import QUERIES

    with store.engine.connect() as conn:
        plan = "\n".join(r[0] for r in conn.execute(
            sa.text("EXPLAIN " + QUERIES["task_sweep_ready_parents"]),
            {"worker": "s", "limit": 100}))
        conn.rollback()
    assert "ix_tasks_waiting" in plan or "idx_tasks_status_agent" in plan, plan
    assert "ix_tasks_parent_id_status" in plan, plan


def test_pickup_is_signalled_by_notify(db_url: str, store: Store) -> None:
    from runtime.store.notify import TaskChannel

    with TaskChannel.open(store.engine) as channel:
        submit(store, agent="echo")
        notes = []
        for payload in channel.notes(timeout=5.0):
            notes.append(payload)
            break
    assert notes == ["echo"]


def test_prune_removes_whole_finished_trees_with_their_events(store: Store) -> None:
    import datetime as dt

    parent, children = parent_with_children(store, 2)
    unfinished = submit(store)
    with store.database.transaction() as conn:
        conn.execute(sa.text("UPDATE tasks SET status = 'done', completed_at = now() - "
                             "interval '2 days' WHERE root_id = :r"), {"r": parent["id"]})
        conn.execute(sa.text("UPDATE tasks SET completed_at = now() - interval '2 days' "
                             "WHERE id = :id"), {"id": unfinished["id"]})
    assert store.reads.prune(dt.timedelta(days=1)) == (1, 3)
    with store.engine.connect() as conn:
        left = conn.execute(sa.text("SELECT count(*) FROM task_events WHERE task_id = ANY(:ids)"),
                            {"ids": [parent["id"], *(c["id"] for c in children)]}).scalar()
    assert left == 0
    assert store.reads.get(unfinished["id"])["status"] == "pending"


def _charge(row: TaskRow, tokens: int, n: int = 0, token: uuid.UUID | None = None) -> ModelCharge:
    return ModelCharge(task_id=row.id, lease_token=token or row.lease_token or uuid.uuid4(),
                       attempt=1, call_index=n, backend="test", route="local",
                       route_reason="test", model="m", prompt="p", response="r",
                       prompt_tokens=tokens, completion_tokens=0, duration_seconds=0.0,
                       cost_usd=Decimal(tokens) / 1000)


def test_claims_return_typed_rows_with_a_deadline(store: Store) -> None:
    submit(store, "echo", budget_seconds=120)
    (row,) = store.claims.claim(["echo"], 1, "w", 30)
    assert isinstance(row, TaskRow) and row["id"] == row.id and row.get("nope") is None
    assert row.claimed_at is not None and row.deadline_at is not None
    assert round((row.deadline_at - row.claimed_at).total_seconds()) == 120


def test_rows_built_per_result_equal_rows_built_per_mapping(store: Store) -> None:
    submit(store, "echo", budget_seconds=60)
    submit(store, "echo", budget_seconds=90)
    rows = store.claims.claim(["echo"], 2, "w", 30)
    with store.engine.connect() as conn:
        result = conn.execute(sa.text("SELECT *, 1 AS not_a_column FROM tasks ORDER BY id"))
        keys, values = list(result.keys()), result.all()
    by_result = TaskRow.from_rows(keys, values)
    by_mapping = [TaskRow.from_mapping(dict(zip(keys, v, strict=True))) for v in values]
    assert by_result == by_mapping
    assert sorted(r.id for r in by_result) == sorted(r.id for r in rows)
    assert {r.budget_seconds for r in by_result} == {60, 90}


def test_a_charge_touches_only_its_task_and_spend_rolls_up_when_it_ends(store: Store) -> None:
    root, _ = parent_with_children(store, 2)
    a, b = store.claims.claim(["echo"], 2, "w", 30)
    assert store.spend.charge(_charge(a, 10)) and store.spend.charge(_charge(b, 5))
    assert store.reads.get(root["id"])["spent_tokens"] == 0  # no hot root row
    assert store.spend.live(root["id"])[:2] == (15, Decimal("0.015"))
    store.transitions.finish_running([RunOutcome(a.id, a.lease_token, "failed", error="x")], "w")
    assert store.reads.get(root["id"])["spent_tokens"] == 10
    store.transitions.finish_running([RunOutcome(b.id, b.lease_token, "failed", error="x")], "w")
    parent = store.reads.get(root["id"])
    assert parent["spent_tokens"] == 15 and parent["status"] == "ready_to_aggregate"
    # A child retried by its parent rolls up only what it spends afterwards.
    (agg,) = store.claims.claim([root["to_agent"]], 1, "w", 30)
    store.transitions.retry_children(agg.id, agg.lease_token, [a.id], "w")
    (again,) = store.claims.claim(["echo"], 1, "w", 30)
    assert store.spend.charge(_charge(again, 7))
    store.transitions.finish_running([RunOutcome(again.id, again.lease_token, "failed",
                                                 error="x")], "w")
    assert store.reads.get(root["id"])["spent_tokens"] == 22 == store.spend.live(root["id"])[0]


def test_charge_many_sums_per_task_and_skips_a_lost_lease(store: Store) -> None:
    root, _ = parent_with_children(store, 2)
    a, b = store.claims.claim(["echo"], 2, "w", 30)
    cloud = dataclasses.replace(_charge(a, 4, 1), route="cloud", model="big")
    done = store.spend.charge_many([_charge(a, 3, 0), _charge(b, 5, 0), cloud,
                                    _charge(b, 9, 1, token=uuid.uuid4())])
    assert done == [True, True, True, False]
    assert store.reads.get(a.id)["own_tokens"] == 7 and store.reads.get(b.id)["own_tokens"] == 5
    # A task's route and model are its last recorded call's.
    assert (store.reads.get(a.id)["route"], store.reads.get(a.id)["model"]) == ("cloud", "big")
    assert (store.reads.get(b.id)["route"], store.reads.get(b.id)["model"]) == ("local", "m")
    calls = store.reads.model_calls(a.id) + store.reads.model_calls(b.id)
    assert len(calls) == 3 and {c["root_id"] for c in calls} == {root["id"]}


def test_the_charge_writer_batches_concurrent_charges(store: Store) -> None:
    store.tasks.submit_many("echo", "task", [{"goal": str(i)} for i in range(200)])
    rows = store.claims.claim(["echo"], 200, "w", 30)
    writer = ChargeWriter(store)
    try:
        with ThreadPoolExecutor(max_workers=200) as pool:
            results = list(pool.map(lambda r: writer.charge(_charge(r, 2)), rows))
        stale = writer.charge(_charge(rows[0], 2, token=uuid.uuid4()))
    finally:
        writer.close()
    assert all(results) and stale is False
    assert writer.charges == 201 and writer.batches < 201
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT sum(own_tokens) FROM tasks")).scalar() == 400


def test_maintenance_runs_once_per_interval_across_workers(store: Store) -> None:
    one = Maintenance(store, 3, 60)
    other = Maintenance(store, 3, 60)
    assert one.run_once() is not None
    assert other.run_once() is None and one.run_once() is None
    assert Maintenance(store, 3, 0).run_once() is not None


def test_maintenance_skips_while_another_worker_holds_the_lock(store: Store) -> None:
    from runtime.store.store import MAINTENANCE_LOCK_KEY

    with store.engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MAINTENANCE_LOCK_KEY})
        assert Maintenance(store, 3, 0).run_once() is None
        conn.rollback()
    assert Maintenance(store, 3, 0).run_once() is not None


def test_delegate_many_is_one_transaction_of_guarded_delegations(store: Store) -> None:
    for _ in range(2):
        submit(store, "fanout")
    a, b = store.claims.claim(["fanout"], 2, "w", 30)
    done = store.transitions.delegate_many([(a.id, a.lease, child_rows(3, prefix="a"), None),
                                            (b.id, uuid.uuid4(), child_rows(2, prefix="b"),
                                             "stale")], "w")
    assert done == [(True, 3), (False, 0)]
    assert store.reads.get(a.id)["status"] == "waiting" and len(store.reads.children(a.id)) == 3
    assert store.reads.get(b.id)["status"] == "running" and store.reads.children(b.id) == []
    # Idempotent: the same keys again insert nothing (the parent is no longer running).
    assert store.transitions.delegate_many(
        [(a.id, a.lease, child_rows(3, prefix="a"), None)], "w") == [(False, 0)]


def test_one_delegation_statement_keeps_each_parents_children_in_order(store: Store) -> None:
    for _ in range(3):
        submit(store, "fanout")
    parents = store.claims.claim(["fanout"], 3, "w", 30)
    done = store.transitions.delegate_many([(p.id, p.lease, child_rows(4, prefix=f"p{n}"),
                                             f"batch {n}") for n, p in enumerate(parents)], "w")
    assert done == [(True, 4)] * 3
    for n, parent in enumerate(parents):
        kids = sorted(store.reads.children(parent.id), key=lambda c: c["created_at"])
        assert [c["idempotency_key"] for c in kids] == [f"p{n}{i}" for i in range(4)]
        events = store.reads.events(parent.id)
        assert [(e["to_status"], e["detail"]) for e in events][-1] == ("waiting", f"batch {n}")
        for kid in kids:
            assert [e["to_status"] for e in store.reads.events(kid["id"])] == ["pending"]
