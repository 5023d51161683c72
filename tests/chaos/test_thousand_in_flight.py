"""Chaos: a worker holding a thousand tasks in flight is SIGKILLed; nothing is lost.

One tree: a root fans out to 25 branches of 40 ``spender`` leaves (1,026 tasks). The
leaves are ``async def`` and nap before their model call, so one ``orgchart worker`` at
its defaults (``max_in_flight`` 1,000) claims and holds all 1,000 of them at once. It is
SIGKILLed while it holds them; a second worker starts. What must hold: the tree ends
``done``; every task has exactly one terminal transition; every leaf the dead worker held
was reaped (its lease expired) and finished by the other worker; no parent has a child
twice; each leaf's model call is recorded once; every parent's spend is its own plus its
children's.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal

import pytest
import sqlalchemy as sa

from runtime.store.rows import NewTask
from runtime.store.store import Store
from tests.chaos.helpers import (
    Fleet,
    after_reaping,
    assert_audited,
    duplicate_children,
    held_by,
    parent_spend_mismatches,
    spend_mismatches,
    status_counts,
    unfinished,
    wait_until,
)
from tests.factories import terminal_event_counts

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

BRANCHES, LEAVES = 25, 40
TASKS = 1 + BRANCHES * (1 + LEAVES)
IN_FLIGHT = BRANCHES * LEAVES  # 1,000: the [worker] max_in_flight default
#: The leaves' nap: long enough for one worker to claim all of them before it is killed.
LEAF_SLEEP_SECONDS = 12.0
LEASE_SECONDS = 2


def test_a_worker_killed_with_a_thousand_tasks_in_flight_loses_none(
        store: Store, make_fleet: Callable[[list[str]], Fleet]) -> None:
    root, _ = store.tasks.submit(NewTask(
        to_agent="spend_fanout", type="task",
        payload={"goal": "a thousand in flight", "n": BRANCHES, "inner": LEAVES,
                 "sleep": LEAF_SLEEP_SECONDS},
        budget_tokens=10_000_000, budget_usd=Decimal(1000), budget_seconds=3600))
    fleet = make_fleet(["--agents-module", "tests.chaos.agents",
                        "--lease-seconds", str(LEASE_SECONDS)])
    first = fleet.start()

    most = [0]

    def holding_all() -> list[dict[str, object]] | None:
        held = [t for t in held_by(store, first.pid)
                if t["to_agent"] == "spender" and t["status"] == "running"]
        most[0] = max(most[0], len(held))
        return held if len(held) >= IN_FLIGHT else None

    try:
        wait_until(holding_all, 90, f"one worker to hold {IN_FLIGHT} leaves at once")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: it held {most[0]} at most; now "
                             f"{dict(status_counts(store))}\n{first.log()}") from None
    fleet.sigkill(first)
    held = [t for t in held_by(store, first.pid) if t["to_agent"] == "spender"]
    assert len(held) == IN_FLIGHT, "the killed worker's leases changed after it died"
    victim = str(held[0]["lease_owner"])
    fleet.start()

    wait_until(lambda: unfinished(store) == 0, 120,
               f"the tree to finish; now {dict(status_counts(store))}")

    assert status_counts(store) == {"done": TASKS}
    assert store.reads.get(root["id"])["status"] == "done"
    counts = terminal_event_counts(store)
    assert len(counts) == TASKS and {t: n for t, n in counts.items() if n != 1} == {}
    assert duplicate_children(store) == []
    for task in held:
        after = after_reaping(store, task["id"])
        assert all(e["worker"] != victim for e in after), after
    with store.engine.connect() as conn:
        calls = conn.execute(sa.text(
            "SELECT count(*) AS calls, count(DISTINCT m.task_id) AS leaves "
            "FROM model_calls m JOIN tasks t ON t.id = m.task_id "
            "WHERE t.to_agent = 'spender' AND NOT m.replayed")).one()
    # The dead worker's leaves were napping: none of them had called the model yet.
    assert (calls.calls, calls.leaves) == (IN_FLIGHT, IN_FLIGHT)
    assert spend_mismatches(store) == [] and parent_spend_mismatches(store) == 0
    assert not fleet.unexpected_exits()
    assert_audited(store, fleet.recorder)
