"""Cost-weighted fair time (issue 25): a tree's steps grow with what its calls cost.

The charge statement (``task_charge_running_many``) adds a tree's tokens to its clock
(migration 0012) and respaces its pending tasks when its cost per call moves; the claim
then takes a dear tree's tasks as often as its share of tokens allows.
"""

from __future__ import annotations

import itertools
import uuid
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from runtime.store.rows import ModelCharge, Tenancy
from runtime.store.store import Store
from tests.factories import child_rows, submit

QUANTUM_TOKENS = 100.0


def _charge(task: dict[str, Any], tokens: int, token: uuid.UUID | None = None) -> ModelCharge:
    return ModelCharge(task["id"], token or task["lease_token"], 1, 1, "offline", "local",
                       "test", "m", "p", "r", tokens - 1, 1, 0.1, Decimal(0),
                       position=str(uuid.uuid4()))


def _tree(store: Store, n: int, tenant: str = "default") -> tuple[dict[str, Any], list[Any]]:
    """A root (claimed and delegated) with ``n`` pending children; returns the root row."""
    root = submit(store, "fanout", tenant=tenant)
    [claimed] = [c for c in store.claims.claim(["fanout"], 10, "w", 30) if c["id"] == root["id"]]
    applied, inserted = store.transitions.delegate(claimed["id"], claimed["lease_token"],
                                                   child_rows(n, prefix=f"{tenant}-"), "w")
    assert applied and inserted == n
    return root, [k["id"] for k in store.reads.children(root["id"])]


def _clock(store: Store, root: dict[str, Any]) -> tuple[float, int, float]:
    with store.engine.connect() as conn:
        row = conn.execute(sa.text("SELECT spent, calls, factor FROM tree_clocks "
                                   "WHERE root_id = :r"), {"r": root["id"]}).one()
    return float(row[0]), int(row[1]), float(row[2])


def _pending_gaps(store: Store, root: dict[str, Any]) -> list[float]:
    with store.engine.connect() as conn:
        times = [r[0] for r in conn.execute(sa.text(
            "SELECT fair_at FROM tasks WHERE root_id = :r AND status = 'pending' "
            "ORDER BY fair_at"), {"r": root["id"]})]
    return [round((b - a).total_seconds(), 3) for a, b in itertools.pairwise(times)]


def test_a_dear_trees_pending_tasks_move_apart_and_it_is_claimed_less(store: Store) -> None:
    store.policies.tenancy = Tenancy(quantum_seconds=1.0, quantum_tokens=QUANTUM_TOKENS)
    dear, _ = _tree(store, 12, "dear")
    cheap, _ = _tree(store, 12, "cheap")
    [first] = store.claims.claim(["echo"], 1, "w", 30)  # the dear tree's first child
    assert first["root_id"] == dear["id"]
    assert store.spend.charge_many([_charge(first, 1000)]) == [True]  # 10 steps' worth
    assert _clock(store, dear) == (1000.0, 1, 10.0)
    assert set(_pending_gaps(store, dear)) == {10.0}
    assert set(_pending_gaps(store, cheap)) == {1.0}
    claimed = store.claims.claim(["echo"], 11, "w", 30)
    by_tree = {r: sum(c["root_id"] == r for c in claimed) for r in (dear["id"], cheap["id"])}
    assert by_tree == {dear["id"]: 1, cheap["id"]: 10}, by_tree
    # A cheap call leaves a tree at one step (never below): no respacing.
    [one] = [c for c in claimed if c["root_id"] == cheap["id"]][:1]
    assert store.spend.charge_many([_charge(one, 20)]) == [True]
    assert _clock(store, cheap) == (20.0, 1, 1.0)


def test_a_small_move_of_the_cost_does_not_respace(store: Store) -> None:
    store.policies.tenancy = Tenancy(quantum_seconds=1.0, quantum_tokens=QUANTUM_TOKENS)
    tree, _ = _tree(store, 6, "t")
    a, b = store.claims.claim(["echo"], 2, "w", 30)
    assert store.spend.charge_many([_charge(a, 400)]) == [True]
    assert _clock(store, tree)[2] == 4.0
    before = _pending_gaps(store, tree)
    assert store.spend.charge_many([_charge(b, 450)]) == [True]  # average 425: within a quarter
    assert _clock(store, tree) == (850.0, 2, 4.0)
    assert _pending_gaps(store, tree) == before


def test_a_late_workers_charge_moves_no_clock(store: Store) -> None:
    store.policies.tenancy = Tenancy(quantum_seconds=1.0, quantum_tokens=QUANTUM_TOKENS)
    tree, _ = _tree(store, 3, "t")
    [task] = store.claims.claim(["echo"], 1, "w", 30)
    assert store.spend.charge_many([_charge(task, 5000, token=uuid.uuid4())]) == [False]
    assert _clock(store, tree) == (0.0, 0, 1.0)
    assert set(_pending_gaps(store, tree)) == {1.0}


def test_a_tree_that_never_delegated_is_charged_as_before(store: Store) -> None:
    root = submit(store, "echo")
    [task] = store.claims.claim(["echo"], 1, "w", 30)
    assert task["id"] == root["id"]
    assert store.spend.charge_many([_charge(task, 5000)]) == [True]
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM tree_clocks")).scalar_one() == 0
        assert conn.execute(sa.text("SELECT spent_tokens FROM tasks WHERE id = :i"),
                            {"i": root["id"]}).scalar_one() == 5000
