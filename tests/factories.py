"""Factories for tests: insert tasks in a given state, straight through the store."""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from runtime.store.rows import ChildRow, NewTask
from runtime.store.store import Store


def submit(store: Store, agent: str = "echo", payload: dict[str, Any] | None = None,
           **kw: Any) -> dict[str, Any]:
    """Submit one root task and return its row."""
    task, _ = store.tasks.submit(NewTask(to_agent=agent, type=kw.pop("type", "task"),
                                         payload=payload or {"goal": "test"}, **kw))
    return task


def child_rows(n: int, agent: str = "echo", prefix: str = "c") -> list[ChildRow]:
    """``n`` children with distinct keys and small budgets."""
    return [ChildRow(agent, "task", {"goal": f"child {i}"}, f"{prefix}{i}", 100, 60,
                     Decimal("0.01")) for i in range(n)]


def parent_with_children(store: Store, n: int, agent: str = "echo",
                         parent_agent: str = "fanout") -> tuple[dict[str, Any],
                                                                list[dict[str, Any]]]:
    """A root that delegated to ``n`` children (children pending, parent waiting)."""
    root = submit(store, parent_agent)
    claimed = store.claims.claim([parent_agent], 1, "w-parent", 30)
    assert claimed and claimed[0]["id"] == root["id"]
    applied, inserted = store.transitions.delegate(root["id"], claimed[0]["lease_token"],
                                                   child_rows(n, agent), "w-parent")
    assert applied and inserted == n
    return store.reads.get(root["id"]), store.reads.children(root["id"])


def expire_leases(store: Store, minutes: int = 10, where: str = "lease_token IS NOT NULL") -> int:
    """Pretend leases expired ``minutes`` ago (a dead worker)."""
    with store.database.transaction() as conn:
        return conn.execute(sa.text(
            "UPDATE tasks SET lease_expires_at = now() - make_interval(mins => :m) "
            f"WHERE {where}"), {"m": minutes}).rowcount


def hand_over(store: Store, task_id: uuid.UUID, owner: str = "w-other") -> uuid.UUID:
    """What the reaper and another worker's claim leave: the running task under a new token.

    One statement, so a worker under test cannot claim the task back in between.
    """
    with store.database.transaction() as conn:
        return conn.execute(sa.text(
            "UPDATE tasks SET lease_token = gen_random_uuid(), lease_owner = :owner, "
            "delivery_count = delivery_count + 1, claimed_at = now() "
            "WHERE id = :id AND status = 'running' RETURNING lease_token"),
            {"id": task_id, "owner": owner}).scalar_one()


def backdate_claims(store: Store, seconds: int) -> None:
    """Pretend running tasks were claimed ``seconds`` ago (for the watchdog's deadline)."""
    with store.database.transaction() as conn:
        conn.execute(sa.text("UPDATE tasks SET claimed_at = now() - make_interval(secs => :s), "
                             "deadline_at = deadline_at - make_interval(secs => :s) "
                             "WHERE status = 'running'"), {"s": seconds})


def events(store: Store, task_id: uuid.UUID) -> list[tuple[str | None, str]]:
    """(from, to) pairs of a task's history."""
    return [(e["from_status"], e["to_status"]) for e in store.reads.events(task_id)]


def terminal_event_counts(store: Store) -> dict[uuid.UUID, int]:
    """Terminal transitions per task, resolutions and aggregate retries aside."""
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT t.id, count(e.id) FILTER ("
            "  WHERE e.to_status IN ('done','failed','escalated','cancelled')"
            "  AND e.from_status IS DISTINCT FROM 'escalated') AS n "
            "FROM tasks t LEFT JOIN task_events e ON e.task_id = t.id GROUP BY t.id")).all()
    return {r.id: int(r.n) for r in rows}
