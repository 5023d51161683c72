"""Tenants (issue 25): inherited by a tree, fair time at the claim, max_in_flight held."""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from typing import Any

import sqlalchemy as sa

from runtime.store.queries import QUERIES
from runtime.store.rows import Tenancy
from runtime.store.store import Store
from runtime.views import tree_for, tree_text
from tests.factories import child_rows, expire_leases, submit

QUANTUM = 0.5


def _delegate(store: Store, task: dict[str, Any], n: int, agent: str = "echo",
              prefix: str = "c") -> list[dict[str, Any]]:
    applied, inserted = store.transitions.delegate(task["id"], task["lease_token"],
                                                   child_rows(n, agent, prefix), "w")
    assert applied and inserted == n
    return store.reads.children(task["id"])


def _claim_one(store: Store, task_id: uuid.UUID, agent: str) -> dict[str, Any]:
    claimed = store.claims.claim([agent], 1, "w", 30)
    assert [c["id"] for c in claimed] == [task_id]
    return claimed[0]


def test_the_whole_tree_inherits_the_roots_tenant(store: Store) -> None:
    root = submit(store, "fanout", tenant="acme")
    assert root["tenant"] == "acme"
    kids = _delegate(store, _claim_one(store, root["id"], "fanout"), 2, agent="fanout")
    assert {k["tenant"] for k in kids} == {"acme"}
    grandkids = _delegate(store, _claim_one(store, kids[0]["id"], "fanout"), 2, prefix="g")
    assert {g["tenant"] for g in grandkids} == {"acme"}
    assert submit(store)["tenant"] == "default"
    tree = tree_for(store, root["id"])
    assert tree["tenant"] == "acme" and tree["children"][0]["tenant"] == "acme"
    summary = json.loads(tree_text(store, root["id"], fields="summary")[0])
    assert summary["tenant"] == "acme"


def test_one_parents_children_are_spaced_by_the_quantum_over_the_weight(store: Store) -> None:
    store.policies.tenancy = Tenancy(weights={"acme": 4.0}, quantum_seconds=2.0)
    root = submit(store, "fanout", tenant="acme")
    kids = _delegate(store, _claim_one(store, root["id"], "fanout"), 3)
    times = sorted(k["fair_at"] for k in kids)
    gaps = {round((b - a).total_seconds(), 3) for a, b in itertools.pairwise(times)}
    assert gaps == {0.5}, gaps


def test_a_trees_tasks_are_one_step_apart_whatever_its_shape(store: Store) -> None:
    store.policies.tenancy = Tenancy(quantum_seconds=10.0)
    root = submit(store, "fanout")
    leads = _delegate(store, _claim_one(store, root["id"], "fanout"), 3, agent="fanout")
    claimed = store.claims.claim(["fanout"], 3, "w", 30)
    assert len(claimed) == 3
    first, *rest = claimed  # in fair order
    _delegate(store, first, 2, prefix="a")  # alone
    applied = store.transitions.delegate_many(  # together
        [(r["id"], r["lease_token"], child_rows(2, prefix=f"b{i}"), None)
         for i, r in enumerate(rest)], "w")
    assert applied == [(True, 2), (True, 2)]
    with store.engine.connect() as conn:
        times = [r[0] for r in conn.execute(sa.text(
            "SELECT fair_at FROM tasks WHERE root_id = :r AND depth > 0 ORDER BY fair_at"),
            {"r": root["id"]})]
    assert len(times) == 3 + 6 and len(leads) == 3
    gaps = [round((b - a).total_seconds(), 2) for a, b in itertools.pairwise(times)]
    assert all(g >= 9.99 for g in gaps), gaps


def test_no_fair_time_is_later_than_creation_plus_max_wait(store: Store) -> None:
    store.policies.tenancy = Tenancy(quantum_seconds=10.0, max_wait_seconds=25.0)
    root = submit(store, "fanout")
    kids = _delegate(store, _claim_one(store, root["id"], "fanout"), 5)
    late = sorted((k["fair_at"] - k["created_at"]).total_seconds() for k in kids)
    assert all(abs(a - b) < 0.5 for a, b in zip(late, [10, 20, 25, 25, 25], strict=True)), late


def test_a_newer_small_tree_is_claimed_before_a_wide_trees_later_children(
        store: Store) -> None:
    wide = submit(store, "fanout", tenant="big")
    _delegate(store, _claim_one(store, wide["id"], "fanout"), 200)
    first = store.claims.claim(["echo"], 20, "w", 30)  # the wide tree's first 20 children
    assert {c["root_id"] for c in first} == {wide["id"]}
    small = submit(store, "echo", tenant="small")
    claimed = store.claims.claim(["echo"], 1, "w", 30)
    assert [c["id"] for c in claimed] == [small["id"]]


def test_weights_share_the_claims_between_two_wide_trees(store: Store) -> None:
    store.policies.tenancy = Tenancy(weights={"heavy": 3.0, "light": 1.0}, quantum_seconds=QUANTUM)
    for tenant in ("heavy", "light"):
        root = submit(store, "fanout", tenant=tenant)
        _delegate(store, _claim_one(store, root["id"], "fanout"), 100)
    claimed = store.claims.claim(["echo"], 40, "w", 30)
    by_tenant = {t: sum(1 for c in claimed if c["tenant"] == t) for t in ("heavy", "light")}
    assert 28 <= by_tenant["heavy"] <= 32 and by_tenant["heavy"] + by_tenant["light"] == 40, \
        by_tenant


def _running(store: Store, tenant: str) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM tasks WHERE status = 'running' AND tenant = :t "
            "AND lease_expires_at > now()"), {"t": tenant}).scalar_one())


def test_max_in_flight_holds_across_concurrent_claimers(store: Store) -> None:
    store.policies.tenancy = Tenancy(caps={"acme": 5})
    for i in range(40):
        submit(store, tenant="acme", payload={"goal": f"a{i}"})
    for i in range(10):
        submit(store, payload={"goal": f"d{i}"})
    start = threading.Barrier(8)
    got: list[int] = []
    lock = threading.Lock()

    def claimer() -> None:
        start.wait()
        for _ in range(5):
            rows = store.claims.claim(["echo"], 3, f"w{threading.get_ident()}", 30)
            with lock:
                got.extend(1 for r in rows if r["tenant"] == "acme")

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(got) == 5 == _running(store, "acme")
    assert _running(store, "default") == 10  # the uncapped tenant is not held back


def test_a_dead_workers_expired_leases_stop_counting(store: Store) -> None:
    store.policies.tenancy = Tenancy(caps={"acme": 2})
    for i in range(5):
        submit(store, tenant="acme", payload={"goal": f"a{i}"})
    assert len(store.claims.claim(["echo"], 10, "dead", 30)) == 2
    assert store.claims.claim(["echo"], 10, "w", 30) == []
    expire_leases(store)  # the worker was SIGKILLed: its leases ran out, no reaper yet
    assert len(store.claims.claim(["echo"], 10, "w", 30)) == 2


def test_the_claim_walks_the_partial_index_with_capped_tenants(store: Store) -> None:
    with store.database.transaction() as conn:
        conn.execute(sa.text(
            "INSERT INTO tasks (to_agent, type, payload, status, completed_at) "
            "SELECT 'echo', 'task', '{}', 'done', now() FROM generate_series(1, 20000)"))
        conn.execute(sa.text("ANALYZE tasks"))
    submit(store, tenant="acme")
    with store.engine.connect() as conn:
        plan = "\n".join(r[0] for r in conn.execute(
            sa.text("EXPLAIN " + QUERIES["task_claim_capped"]),
            {"agents": ["echo"], "limit": 10, "worker": "w", "lease_seconds": 30.0,
             "cap_tenants": ["acme"], "caps": [3], "dry_tenants": ["beta"]}))
        conn.rollback()
    assert plan.count("ix_tasks_claimable") >= 1, plan
    assert "ix_tasks_tenant_running" in plan, plan
    assert "Seq Scan on tasks" not in plan, plan
