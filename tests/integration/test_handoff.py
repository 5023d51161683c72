"""Hand-offs: work a worker's own write makes claimable is leased to it in that write.

The last child's finish hands its parent's aggregate up to the finishing worker, a
delegation hands its children down to the delegating worker (``Handoff``;
``task_claim_handed``), with no claim round trip, within what the worker's next claim
could take: its agents, its room, no pause, no cancel, no capped tenant, nothing ahead in
the fair order. Against a real PostgreSQL.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from agents.base import Agent, ChildSpec, ChildView, Delegate, Result, TaskView
from agents.context import AgentContext
from runtime.audit.checker import audit
from runtime.store.postgres import urls
from runtime.store.queries import TASKS_CHANNEL
from runtime.store.rows import HANDED_DOWN, HANDED_UP, Handoff, RunOutcome, TaskRow
from runtime.store.store import Store
from runtime.wiring import Runtime
from tests.factories import child_rows, hand_over, submit, terminal_event_counts
from tests.support import wait_until
from tests.support_agents import AnyInput, AnyOutput

W = "w-hand"


class HandoffLink(Agent):
    """One level of a chain: delegates the next level until ``depth``; hands its answer up."""

    name = "handoff_link"
    input_model = AnyInput
    output_model = AnyOutput
    delegates_to = ("handoff_link",)

    async def run(self, ctx: AgentContext, task: TaskView) -> Delegate | Result:
        level, depth = int(task.payload["level"]), int(task.payload["depth"])
        if level >= depth:
            return Result({"bottom": level})
        return Delegate([ChildSpec("handoff_link", {"level": level + 1, "depth": depth},
                                   key="next", budget_tokens=task.budget_tokens - 10,
                                   budget_usd=task.budget_usd - Decimal("0.001"))])

    async def aggregate(self, ctx: AgentContext, task: TaskView,
                        children: list[ChildView]) -> Result:
        return Result(children[0].result)


def offer(agents: tuple[str, ...] = ("fanout", "echo"), room: int = 10) -> Handoff:
    return Handoff(list(agents), room, 30.0)


def claim_children(store: Store, n: int, worker: str = W) -> tuple[dict[str, Any],
                                                                    list[TaskRow]]:
    """A fanout root waiting on ``n`` echo children, all claimed by ``worker``."""
    root = submit(store, "fanout")
    parent = store.claims.claim(["fanout"], 1, "w-parent", 30)[0]
    assert store.transitions.delegate(root["id"], parent.lease, child_rows(n),
                                      "w-parent") == (True, n)
    kids = store.claims.claim(["echo"], n, worker, 30)
    assert len(kids) == n
    return root, kids


def done(row: TaskRow) -> RunOutcome:
    return RunOutcome(row.id, row.lease, "done", result={"ok": True}, skips_judging=True)


def claim_events(store: Store, task_id: uuid.UUID) -> list[dict[str, Any]]:
    return [e for e in store.reads.events(task_id) if e["to_status"] == "running"]


@pytest.fixture
def listener(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection LISTENing on the task channel (what another worker hears)."""
    with psycopg.connect(urls.libpq_url(db_url), autocommit=True) as conn:
        conn.execute(f"LISTEN {TASKS_CHANNEL}")
        yield conn


def heard(conn: psycopg.Connection[Any]) -> set[str]:
    """The notifications delivered so far (the writes above committed before)."""
    return {n.payload for n in conn.notifies(timeout=0.3, stop_after=10)}


# ---------------------------------------------------------------- hand-up
def test_the_last_childs_finish_hands_the_parent_up_with_no_claim(
        store: Store, listener: psycopg.Connection[Any]) -> None:
    root, (first, last) = claim_children(store, 2)
    handoff = offer()
    store.transitions.finish_running([done(first)], W, handoff)
    assert handoff.taken == [] and store.reads.get(root["id"])["status"] == "waiting"
    heard(listener)
    store.transitions.finish_running([done(last)], W, handoff)
    (parent,) = handoff.take_all()
    assert parent.id == root["id"] and parent.phase == "aggregate"
    row = store.reads.get(root["id"])
    assert row["status"] == "running" and row["lease_owner"] == W
    assert row["lease_token"] == parent.lease_token is not None
    assert row["claimed_at"] is not None and row["deadline_at"] > row["claimed_at"]
    assert handoff.room == 9
    # Both transitions have their events, in order; the claim says how it was taken.
    history = store.reads.events(root["id"])
    assert [(e["from_status"], e["to_status"]) for e in history[-2:]] == [
        ("waiting", "ready_to_aggregate"), ("ready_to_aggregate", "running")]
    assert history[-1]["detail"] == "claimed for aggregate, delivery 1" + HANDED_UP
    assert history[-1]["worker"] == W
    # Nobody was told: the parent is not claimable, and no claim round trip took it.
    assert heard(listener) == set()
    assert store.claims.claim(["fanout"], 10, "w-other", 30) == []
    # Its aggregate is written under the handed lease, as after a claim.
    store.transitions.finish_running([done(parent)], W)
    assert store.reads.get(root["id"])["status"] == "done"
    assert set(terminal_event_counts(store).values()) == {1}
    assert audit(store).ok, audit(store).text()


def test_a_paused_parent_is_not_handed_up(store: Store,
                                          listener: psycopg.Connection[Any]) -> None:
    root, (kid,) = claim_children(store, 1)
    store.steering.pause(root["id"])
    handoff = offer()
    store.transitions.finish_running([done(kid)], W, handoff)
    assert handoff.taken == []
    assert store.reads.get(root["id"])["status"] == "ready_to_aggregate"
    assert [e["detail"] for e in claim_events(store, root["id"])] == [
        "claimed for run, delivery 1"]
    assert "fanout" in heard(listener)  # left for a claim after the resume
    store.steering.resume(root["id"])
    assert [t.id for t in store.claims.claim(["fanout"], 1, "w-other", 30)] == [root["id"]]


def test_a_cancelled_parent_is_not_handed_up(store: Store) -> None:
    root, (kid,) = claim_children(store, 1)
    store.steering.cancel(root["id"])
    handoff = offer()
    finished = store.transitions.finish_running([done(kid)], W, handoff)
    assert finished.stale == [kid.id] and handoff.taken == []
    assert store.reads.get(root["id"])["status"] == "cancelled"
    assert len(claim_events(store, root["id"])) == 1


def test_a_parent_of_an_agent_the_worker_does_not_serve_is_left_for_others(
        store: Store, listener: psycopg.Connection[Any]) -> None:
    root, (kid,) = claim_children(store, 1)
    heard(listener)
    handoff = offer(agents=("echo",))
    store.transitions.finish_running([done(kid)], W, handoff)
    assert handoff.taken == []
    assert store.reads.get(root["id"])["status"] == "ready_to_aggregate"
    assert heard(listener) == {"fanout"}
    assert [t.id for t in store.claims.claim(["fanout"], 1, "w-other", 30)] == [root["id"]]


def test_a_worker_without_room_hands_nothing_up_and_others_are_told(
        store: Store, listener: psycopg.Connection[Any]) -> None:
    root, (kid,) = claim_children(store, 1)
    heard(listener)
    handoff = offer(room=0)
    store.transitions.finish_running([done(kid)], W, handoff)
    assert handoff.taken == [] and store.reads.get(root["id"])["status"] == "ready_to_aggregate"
    assert heard(listener) == {"fanout"}


def test_a_late_workers_finish_hands_nothing(store: Store) -> None:
    root, (kid,) = claim_children(store, 1)
    hand_over(store, kid.id)  # the reaper and another worker's claim took it
    handoff = offer()
    finished = store.transitions.finish_running([done(kid)], W, handoff)
    assert finished.stale == [kid.id] and handoff.taken == []
    assert store.reads.get(root["id"])["status"] == "waiting"
    assert store.reads.get(kid.id)["status"] == "running"


def test_a_handoff_never_jumps_the_fair_queue(store: Store) -> None:
    root, (kid,) = claim_children(store, 1)
    with store.database.transaction() as conn:  # another tree's aggregate waits ahead of this one
        conn.exec_driver_sql(
            "UPDATE tasks SET fair_at = fair_at + interval '1 hour' WHERE id = %(id)s",
            {"id": root["id"]})
    other = submit(store, "fanout")
    handoff = offer()
    store.transitions.finish_running([done(kid)], W, handoff)
    assert handoff.taken == [] and store.reads.get(root["id"])["status"] == "ready_to_aggregate"
    assert [t.id for t in store.claims.claim(["fanout"], 1, "w-other", 30)] == [other["id"]]


# ---------------------------------------------------------------- hand-down
def test_a_delegation_hands_its_first_children_down_within_the_room(
        store: Store, listener: psycopg.Connection[Any]) -> None:
    root = submit(store, "fanout")
    parent = store.claims.claim(["fanout"], 1, W, 30)[0]
    heard(listener)
    handoff = offer(room=2)
    assert store.transitions.delegate(root["id"], parent.lease, child_rows(3), W,
                                      handoff=handoff) == (True, 3)
    taken = handoff.take_all()
    assert len(taken) == 2 and all(t.phase == "run" and t.lease_token for t in taken)
    kids = {c["id"]: c for c in store.reads.children(root["id"])}
    assert sorted(c["status"] for c in kids.values()) == ["pending", "running", "running"]
    for t in taken:
        assert kids[t.id]["lease_owner"] == W
        assert [(e["from_status"], e["to_status"], e["detail"]) for e in store.reads.events(t.id)] \
            == [(None, "pending", "delegated by parent"),
                ("pending", "running", "claimed for run, delivery 1" + HANDED_DOWN)]
    assert heard(listener) == {"echo"}  # the third child is announced
    (left,) = store.claims.claim(["echo"], 10, "w-other", 30)
    assert left.id not in {t.id for t in taken}


def test_a_delegation_hands_down_nothing_for_agents_the_worker_does_not_run(
        store: Store, listener: psycopg.Connection[Any]) -> None:
    root = submit(store, "fanout")
    parent = store.claims.claim(["fanout"], 1, W, 30)[0]
    heard(listener)
    handoff = offer(agents=("fanout",))
    store.transitions.delegate(root["id"], parent.lease, child_rows(2), W, handoff=handoff)
    assert handoff.taken == []
    assert heard(listener) == {"echo"}
    assert len(store.claims.claim(["echo"], 10, "w-other", 30)) == 2


def test_a_rerun_parent_whose_children_all_ended_is_handed_its_aggregate(store: Store) -> None:
    """A parent that runs again finds its children done: its delegation flips and hands it up."""
    root, (kid,) = claim_children(store, 1)
    store.transitions.finish_running([done(kid)], W)
    with store.database.transaction() as conn:  # suppose a person sent the parent back to run again
        conn.exec_driver_sql("UPDATE tasks SET status = 'pending', phase = 'run' "
                             "WHERE id = %(id)s", {"id": root["id"]})
    (again,) = store.claims.claim(["fanout"], 1, W, 30)
    handoff = offer()
    assert store.transitions.delegate(root["id"], again.lease, child_rows(1), W,
                                      handoff=handoff) == (True, 0)
    (parent,) = handoff.take_all()
    assert parent.id == root["id"] and parent.phase == "aggregate"
    assert store.reads.events(root["id"])[-1]["detail"] == \
        "claimed for aggregate, delivery 1" + HANDED_UP


# ---------------------------------------------------------------- the worker
@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime]) -> Runtime:
    return make_runtime(ORGCHART_POLICIES__MAX_DEPTH="20")


def test_a_chain_runs_down_and_up_on_one_worker_with_a_single_claim(runtime: Runtime) -> None:
    """Each level's child is handed down, each aggregate handed up: one claim in all.

    The worker neither listens nor polls within the test's time (a 60 s poll): without the
    hand-offs the chain would stop at its second level.
    """
    depth = 6
    root = submit(runtime.store, "handoff_link", {"level": 1, "depth": depth})
    worker = runtime.worker(["handoff_link", "judge"], listen=False, poll_interval_seconds=60,
                            maintenance=False)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: runtime.store.reads.get(root["id"])["status"] == "done",
                   what="the chain's root to be done")
    finally:
        worker.stop("test")
        thread.join(10)
    assert runtime.store.reads.get(root["id"])["result"] == {"bottom": depth}
    ids = [root["id"]]
    while len(ids) < depth:
        (child,) = runtime.store.reads.children(ids[-1])
        ids.append(child["id"])
    details = [e["detail"] for t in ids for e in claim_events(runtime.store, t)]
    assert details.count("claimed for run, delivery 1") == 1  # the root's: the one claim
    assert details.count("claimed for run, delivery 1" + HANDED_DOWN) == depth - 1
    assert details.count("claimed for aggregate, delivery 1" + HANDED_UP) == depth - 1
    assert worker.stats.claimed == 2 * depth - 1
    report = audit(runtime.store)
    assert report.ok, report.text()
