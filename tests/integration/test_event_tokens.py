"""Every transition made under a lease, or making one, records the lease's token.

``task_events.lease_token`` (migration 0016): a claim writes the new token; an outcome,
a delegation, a retry of children, a release the token the worker held; the reaper and
the watchdog the token they took away. Transitions without a lease leave it NULL. The
audit checks promise 7 per delivery with it (tests/integration/test_audit.py).
"""

from __future__ import annotations

import uuid
from typing import Any

from runtime.store.rows import RunOutcome
from runtime.store.store import Store
from tests.factories import (
    backdate_claims,
    expire_leases,
    parent_with_children,
    submit,
)


def last_event(store: Store, task_id: uuid.UUID) -> dict[str, Any]:
    """The task's newest event."""
    return store.reads.events(task_id)[-1]


def claim_one(store: Store, agent: str = "echo") -> dict[str, Any]:
    (task,) = store.claims.claim([agent], 1, "w-1", 30)
    assert last_event(store, task["id"])["lease_token"] == task["lease_token"]
    return task


def test_a_claim_the_reaper_and_a_release_record_the_token(store: Store) -> None:
    root = submit(store)
    assert last_event(store, root["id"])["lease_token"] is None  # submitted: no lease
    first = claim_one(store)
    expire_leases(store)
    assert store.hygiene.reap(max_delivery=5).released == 1
    reaped = last_event(store, root["id"])
    assert (reaped["to_status"], reaped["lease_token"]) == ("pending", first["lease_token"])
    second = claim_one(store)
    assert second["lease_token"] != first["lease_token"]
    assert store.claims.release([second["lease_token"]], "w-1") == 1
    released = last_event(store, root["id"])
    assert (released["to_status"], released["lease_token"]) == ("pending",
                                                                second["lease_token"])


def test_the_watchdog_and_an_outcome_record_the_token_held(store: Store) -> None:
    late, done = submit(store), submit(store)
    (a, b) = store.claims.claim(["echo"], 2, "w-1", 30)
    held = {a["id"]: a["lease_token"], b["id"]: b["lease_token"]}
    backdate_claims(store, 3600)
    store.hygiene.time_out()
    events = {t: last_event(store, t) for t in (late["id"], done["id"])}
    timed_out = [e for e in events.values() if e["to_status"] == "failed"]
    assert timed_out and all(e["lease_token"] == held[e["task_id"]] for e in timed_out)
    third = submit(store)
    task = claim_one(store)
    assert task["id"] == third["id"]
    store.transitions.finish_running([RunOutcome(task["id"], task["lease_token"], "failed",
                                                 error="boom")], "w-1")
    assert last_event(store, task["id"])["lease_token"] == task["lease_token"]


def test_a_delegation_and_a_retry_of_children_record_the_parents_token(store: Store) -> None:
    parent, (child,) = parent_with_children(store, 1)
    delegated = [e for e in store.reads.events(parent["id"]) if e["to_status"] == "waiting"]
    claim = [e for e in store.reads.events(parent["id"]) if e["to_status"] == "running"][-1]
    assert delegated[-1]["lease_token"] == claim["lease_token"] is not None
    assert [e["lease_token"] for e in store.reads.events(child["id"])] == [None]  # inserted
    kid = claim_one(store)
    store.transitions.finish_running([RunOutcome(kid["id"], kid["lease_token"], "failed",
                                                 error="boom")], "w-1")
    store.hygiene.sweep()
    (agg,) = store.claims.claim(["fanout"], 1, "w-2", 30)
    assert agg["id"] == parent["id"] and agg["phase"] == "aggregate"
    assert store.transitions.retry_children(agg["id"], agg["lease_token"], [kid["id"]], "w-2") == 1
    back = last_event(store, parent["id"])
    assert (back["to_status"], back["lease_token"]) == ("waiting", agg["lease_token"])
    assert last_event(store, kid["id"])["lease_token"] is None  # failed -> pending: no lease
