"""Batched writes reach their rows by the primary key, whatever the statistics say.

A queue's statistics, taken when most tasks wait, count few running or leased rows. The
planner then found a partial index on running (or leased) rows cheaper than the primary
key for the UPDATE's side of a batch, and walked the whole index once per batch row:
a 296-row finish in a drain took 65 ms (44,000 index rows read), a heartbeat over 1,000
leases 250 ms instead of 30, a reap of 1,000 expired leases 275 ms instead of 53 (each
holding its row locks meanwhile); a claim of 200, joined to the CTE that picked its
rows, was planned as a hash join over a sequential scan of the whole table. These tests
capture the statement the store sends and ask PostgreSQL for its plan under those
statistics: the UPDATE must read ``tasks`` through ``pk_tasks``, or a claim by the places
its CTE locked (a TID scan). Each failed before its statement was fixed (the guard moved
to the CTE that locks the rows; the claims update ``WHERE ctid = ANY(ARRAY(SELECT tid
FROM picked))``, by id before).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from bench.common import submit_noop
from runtime.store.rows import RunOutcome
from runtime.store.store import Store

HELD = 300


def _analyze(store: Store) -> None:
    with store.engine.begin() as conn:
        conn.execute(sa.text("ANALYZE tasks"))


@contextmanager
def _captured(store: Store, marker: str) -> Iterator[list[tuple[str, Any]]]:
    """Capture the statements (and parameters) that contain ``marker`` while open."""
    seen: list[tuple[str, Any]] = []

    def listen(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
               executemany: bool) -> None:
        if marker in statement:
            seen.append((statement, parameters))

    sa.event.listen(store.engine, "before_cursor_execute", listen)
    try:
        yield seen
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", listen)


def _plan(store: Store, statement: str, parameters: Any) -> dict[str, Any]:
    """The plan PostgreSQL picks for a captured statement (not run: EXPLAIN only)."""
    raw = store.engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("EXPLAIN (FORMAT JSON) " + statement, parameters)
        plan = cursor.fetchone()[0][0]["Plan"]
        raw.rollback()
        return plan
    finally:
        raw.close()


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def _update_reads(plan: dict[str, Any]) -> list[tuple[str, str | None]]:
    """How each UPDATE of ``tasks`` reads its target rows: (node type, index name)."""
    reads = []
    for node in _nodes(plan):
        if node.get("Node Type") != "ModifyTable" or node.get("Relation Name") != "tasks":
            continue
        alias = node.get("Alias")
        for scan in _nodes(node):
            if scan is not node and scan.get("Relation Name") == "tasks" \
                    and scan.get("Alias") == alias:
                index = scan.get("Index Name")
                if scan["Node Type"] == "Bitmap Heap Scan":  # the index is its child's
                    index = next((b.get("Index Name") for b in _nodes(scan)
                                  if b.get("Node Type") == "Bitmap Index Scan"), None)
                reads.append((scan["Node Type"], index))
    return reads


def _assert_by_key(store: Store, marker: str, call: Callable[[], Any],
                   by: tuple[str, str | None] = ("Index Scan", "pk_tasks")) -> Any:
    """Run ``call``; its statement marked ``marker`` must update tasks ``by`` a key. Its result.

    ``by`` is the read: (node type, index); an index scan and a bitmap scan of the same
    index are the same read here.
    """
    with _captured(store, marker) as seen:
        result = call()
    assert seen, f"no statement containing {marker!r} was sent"
    reads = _update_reads(_plan(store, *seen[0]))
    assert reads, "the statement updates no tasks"
    if by[1] is not None:
        assert all(index == by[1] for _, index in reads), reads
    else:
        assert all(node == by[0] for node, _ in reads), reads
    return result


def _queue(store: Store, pending: int = 2000, lease_seconds: float = 60.0) -> list[Any]:
    """``pending`` queued tasks, their statistics taken, and ``HELD`` of them claimed."""
    submit_noop(store, pending)
    _analyze(store)  # the statistics of a waiting queue: nothing running, nothing leased
    return store.claims.claim(["noop"], HELD, "w", lease_seconds)


def test_a_claim_updates_its_rows_by_place(store: Store) -> None:
    submit_noop(store, 20_000)
    _analyze(store)
    claimed = _assert_by_key(store, "Claim up to",
                             lambda: store.claims.claim(["noop"], 200, "w", 60),
                             by=("Tid Scan", None))
    assert len(claimed) == 200  # joined to its CTE, a claim of 200 read the whole table
    assert {r.claimed_from for r in claimed} == {"pending"}
    assert {r.phase for r in claimed} == {"run"}


def test_a_batch_finish_updates_its_rows_by_key(store: Store) -> None:
    rows = _queue(store, pending=20_000)  # the drain's queue (with 2,000 the plan was right)
    outcomes = [RunOutcome(r.id, r.lease_token, "judging", result={"ok": True}) for r in rows]
    _assert_by_key(store, "Move leased running tasks",
                   lambda: store.transitions.finish_running(outcomes, "w"))
    with store.engine.connect() as conn:
        judging = conn.execute(sa.text("SELECT count(*) FROM tasks WHERE status = 'judging'"))
        assert judging.scalar() == HELD


def test_a_heartbeat_over_many_leases_updates_its_rows_by_key(store: Store) -> None:
    rows = _queue(store)
    held = _assert_by_key(store, "Extend the leases a worker still holds",
                          lambda: store.claims.heartbeat([r.lease_token for r in rows], 60.0))
    assert held == {r.lease_token for r in rows}


def test_a_judge_stage_claim_updates_its_rows_by_place(store: Store) -> None:
    rows = _queue(store, pending=20_000)
    store.transitions.finish_running([RunOutcome(r.id, r.lease_token, "judging",
                                                 result={"ok": True}) for r in rows], "w")
    _analyze(store)
    leased = _assert_by_key(store, "Lease up to", lambda: store.claims.claim_judging(200, "w", 60),
                            by=("Tid Scan", None))
    assert len(leased) == 200 and {r.status for r in leased} == {"judging"}


def test_a_reap_of_many_expired_leases_updates_its_rows_by_key(store: Store) -> None:
    rows = _queue(store, lease_seconds=0.05)
    time.sleep(0.1)
    reaped = _assert_by_key(store, "The reaper:", lambda: store.hygiene.reap(3))
    assert set(reaped.ids) == {r.id for r in rows}
