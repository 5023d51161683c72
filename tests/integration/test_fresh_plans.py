"""Tree reads keep their plan's shape on rows PostgreSQL has no statistics for.

A user reads a tree just after it ends; no ANALYZE has seen its rows yet (a fresh
database, or a new tree in a big table, never 10 % of it). On PostgreSQL 15 a join of the
tree's tasks to an aggregate of its calls was then planned as a nested loop re-running
the aggregate for every task: 51 million pairs and 3.5-5.3 s for 10,101 tasks (issue 44).
These tests write a finished 10,000-task tree in one statement, read it with no ANALYZE
(autovacuum is off in the test's private database, so none happens behind its back), and
assert the plan's shape from EXPLAIN: no nested loop filtering pairs, and the rows every
plan node handles (rows times loops, plus rows filtered away) stay linear in the tree's
size. No timing: bench/tree_read.py prints tree_read_fresh_ms.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from runtime.store.queries import TEXT
from runtime.store.store import Store
from runtime.views import tree_text

#: The tree's size: a root, :data:`MIDS` middles, and leaves shared among them.
NODES = 10_000
#: The middle tasks of a tree (the root's children).
MIDS = 100
#: Rows a plan may handle per task of the tree (each task's own row, its events, its calls,
#: the aggregates over them): a plan that pairs tasks with tasks handles thousands.
ROWS_PER_TASK = 40
#: Reads that say who served each task (fragment_task_served): they read a task's calls in
#: one place of the plan (a task served by two backends was read three times: 3 probes).
SERVED_ONCE = ("task_tree_nodes", "task_subtree_nodes", "task_list_tree")

#: A finished tree of :data:`NODES` tasks, written in one statement, each task with two
#: model calls (one offline, charged) and its three transitions.
BUILD_TREE = """
WITH root AS (
    INSERT INTO tasks (id, root_id, to_agent, type, payload, status, depth, result,
                       own_tokens, own_usd, spent_tokens, spent_usd, started_at,
                       completed_at)
    VALUES (:root, :root, 'ceo', 'goal', '{"goal": "fresh"}', 'done', 0, '{"ok": true}',
            10, 0.001, 10, 0.001, now(), now())
    RETURNING id
), mids AS (
    INSERT INTO tasks (id, parent_id, root_id, to_agent, type, payload, status, depth, result,
                       own_tokens, own_usd, idempotency_key, started_at, completed_at)
    SELECT gen_random_uuid(), r.id, r.id, 'lead', 'task',
           jsonb_build_object('goal', 'part ' || m), 'done', 1, '{"ok": true}', 5, 0.0005,
           'part-' || m, now(), now()
    FROM root r, generate_series(1, :mids) AS m
    RETURNING id, root_id, idempotency_key
), leaves AS (  -- leaf l goes under middle l % mids + 1
    INSERT INTO tasks (id, parent_id, root_id, to_agent, type, payload, status, depth, result,
                       own_tokens, own_usd, idempotency_key, started_at, completed_at)
    SELECT gen_random_uuid(), m.id, m.root_id, 'writer', 'task',
           jsonb_build_object('goal', 'leaf ' || l), 'done', 2, '{"ok": true}', 2, 0.0002,
           'leaf-' || l, now(), now()
    FROM generate_series(1, :leaves) AS l
    JOIN mids m ON m.idempotency_key = 'part-' || (l % :mids + 1)
    RETURNING id
), everyone AS (
    SELECT id FROM root UNION ALL SELECT id FROM mids UNION ALL SELECT id FROM leaves
), calls AS (
    INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, model,
                             prompt, response, prompt_tokens, completion_tokens, cost_usd,
                             phase, position, request_hash)
    SELECT e.id, :root, 1, i, CASE WHEN i = 1 THEN 'offline' ELSE 'ollama' END, 'fast', 'm',
           'prompt', 'answer', 3, 2, 0.0001, 'run', 'p' || i, md5(e.id::text || i)
    FROM everyone e, generate_series(1, 2) AS i
)
INSERT INTO task_events (task_id, from_status, to_status, worker)
SELECT e.id, s.f, s.t, 'w-bulk'
FROM everyone e,
     (VALUES (NULL, 'pending', 1), ('pending', 'running', 2), ('running', 'done', 3))
         AS s(f, t, o)
ORDER BY e.id, s.o
"""


def build_finished_tree(store: Store, nodes: int = NODES, mids: int = MIDS) -> uuid.UUID:
    """Write one finished tree of exactly ``nodes`` tasks (no ANALYZE); return its root."""
    leaves = nodes - 1 - mids
    root = uuid.uuid4()
    with store.database.transaction() as conn:
        conn.execute(sa.text(BUILD_TREE), {"root": root, "mids": mids, "leaves": leaves})
    return root


def no_autovacuum(store: Store) -> None:
    """Keep autovacuum's ANALYZE off the test's private database's busy tables."""
    with store.database.transaction() as conn:
        for table in ("tasks", "model_calls", "task_events", "task_steps"):
            conn.execute(sa.text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))


def explain(store: Store, name: str, analyze: bool, **params: Any) -> dict[str, Any]:
    """The top plan node of the named statement (EXPLAIN in JSON, run when ``analyze``)."""
    options = "ANALYZE, FORMAT JSON" if analyze else "FORMAT JSON"
    with store.engine.connect() as conn:
        raw = conn.execute(sa.text(f"EXPLAIN ({options}) {TEXT[name].text}"), params).scalar_one()
    return raw[0]["Plan"]


def nodes_of(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of a plan, top first."""
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes_of(child)


def rows_handled(plan: dict[str, Any]) -> int:
    """Rows every node returned over all its loops, plus the rows filters threw away."""
    total = 0
    for node in nodes_of(plan):
        loops = node.get("Actual Loops", 1)
        total += (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * loops
        total += node.get("Rows Removed by Join Filter", 0)
    return total


def reads(root: uuid.UUID, under: uuid.UUID, ids: list[str]) -> dict[str, dict[str, Any]]:
    """Every tree and subtree read with its parameters, by statement name.

    ``ids`` are the tree's tasks, as a trace export reads them.
    """
    tree = {"root_id": root, "depth": None}
    return {
        "trace_list_tasks": {"ids": ids},
        "trace_list_events": {"ids": ids},
        "trace_list_model_calls": {"ids": ids},
        "step_list_by_tasks": {"ids": ids},
        "task_tree_nodes": {**tree, "summary": False, "part": 0, "parts": 2},
        "task_tree_nodes_summary": {**tree, "summary": True, "part": 1, "parts": 2},
        "task_tree_nodes_one_part": {**tree, "summary": False, "part": 0, "parts": 1},
        "task_subtree_nodes": {**tree, "under": under, "summary": True},
        "task_list_tree": {"root_id": root},
        "task_tree_changes": {"root_id": root, "after": 0, "limit": 5000},
        "timeline_tree": {"root_id": root},
        "model_call_list_tree": {"root_id": root},
        "model_call_count_by_task": {"root_id": root},
    }


def assert_linear_plans(store: Store, root: uuid.UUID) -> None:
    """Every read's plan pairs no rows through a join filter and handles O(tree) rows."""
    with store.engine.connect() as conn:
        under = conn.execute(sa.text(
            "SELECT id FROM tasks WHERE parent_id = :r AND idempotency_key = 'part-1'"),
            {"r": root}).scalar_one()
    ids = [str(i) for i in store.reads.tree_ids(root)]
    for case, params in reads(root, under, ids).items():
        name = case.removesuffix("_summary").removesuffix("_one_part")
        shape = explain(store, name, analyze=False, **params)
        filtered = [n["Join Filter"] for n in nodes_of(shape)
                    if n["Node Type"] == "Nested Loop" and "Join Filter" in n]
        assert not filtered, f"{case}: a nested loop pairs rows through a filter: {filtered}"
        if name in SERVED_ONCE:
            scans = [n for n in nodes_of(shape) if n.get("Relation Name") == "model_calls"]
            assert len(scans) == 1, f"{case} reads model_calls in {len(scans)} places"
        handled = rows_handled(explain(store, name, analyze=True, **params))
        assert handled <= ROWS_PER_TASK * NODES, f"{case} handled {handled} rows"


@pytest.fixture
def quiet_store(store: Store) -> Store:
    """The test's store, autovacuum off (so no statistics appear unless a test makes them)."""
    no_autovacuum(store)
    return store


def test_a_fresh_tree_in_a_fresh_database_is_read_without_pairing_rows(
        quiet_store: Store) -> None:
    root = build_finished_tree(quiet_store)
    assert_linear_plans(quiet_store, root)
    text, _ = tree_text(quiet_store, root, fields="summary")
    assert json.loads(text)["totals"]["tasks"] == NODES


def test_a_fresh_tree_among_analyzed_ones_is_read_without_pairing_rows(
        quiet_store: Store) -> None:
    # Statistics that know one small tree: the new tree's root_id is none of theirs, so
    # PostgreSQL takes it for about one row, as in a big table of older trees.
    build_finished_tree(quiet_store, nodes=14, mids=3)
    with quiet_store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text("ANALYZE tasks, model_calls, task_events, task_steps"))
    root = build_finished_tree(quiet_store)
    assert_linear_plans(quiet_store, root)
    text, _ = tree_text(quiet_store, root)
    assert json.loads(text)["totals"]["tasks"] == NODES


# -- the claim, fan-in, roll-up, reaper and metrics statements on a fresh tree -----------

#: A running tree of 931 tasks: a root and :data:`LEADS` leads waiting, their writers
#: pending, running (some with an expired lease) or done; the first ten leads' writers
#: all done (ready for the fan-in).
LEADS = 30
BUILD_RUNNING_TREE = """
WITH root AS (
    INSERT INTO tasks (id, root_id, to_agent, type, payload, status, depth)
    VALUES (:root, :root, 'ceo', 'goal', '{}', 'waiting', 0) RETURNING id
), leads AS (
    INSERT INTO tasks (id, parent_id, root_id, to_agent, type, payload, status, depth,
                       idempotency_key)
    SELECT gen_random_uuid(), r.id, r.id, 'lead', 'task', '{}', 'waiting', 1, 'lead-' || m
    FROM root r, generate_series(1, :leads) AS m
    RETURNING id, root_id, idempotency_key
), writers AS (
    SELECT l, CASE WHEN l % :leads < 10 THEN 'done'
                   ELSE (ARRAY['pending', 'running', 'done'])[l % 3 + 1] END AS status
    FROM generate_series(1, :writers) AS l
)
INSERT INTO tasks (id, parent_id, root_id, to_agent, type, payload, status, depth,
                   idempotency_key, lease_owner, lease_token, lease_expires_at, claimed_at,
                   spent_tokens, completed_at)
SELECT gen_random_uuid(), m.id, m.root_id, 'writer', 'task', '{}', w.status, 2,
       'writer-' || w.l,
       CASE WHEN w.status = 'running' THEN 'w-1' END,
       CASE WHEN w.status = 'running' THEN gen_random_uuid() END,
       CASE WHEN w.status = 'running'
            THEN now() + CASE WHEN w.l % 2 = 0 THEN interval '-5 s' ELSE interval '30 s' END
       END,
       CASE WHEN w.status = 'running' THEN now() - interval '10 s' END,
       CASE WHEN w.status = 'done' THEN 5 ELSE 0 END,
       CASE WHEN w.status = 'done' THEN now() END
FROM writers w JOIN leads m ON m.idempotency_key = 'lead-' || (w.l % :leads + 1)
"""
#: Rows a statement's plan may handle per task it is given (the task, its children).
ROWS_PER_ID = 40


def build_running_tree(store: Store, writers: int = 900) -> tuple[list[Any], list[Any]]:
    """Write one running tree (no ANALYZE); return its leads' ids and its done writers'."""
    root = uuid.uuid4()
    with store.database.transaction() as conn:
        conn.execute(sa.text(BUILD_RUNNING_TREE),
                     {"root": root, "leads": LEADS, "writers": writers})
        leads = list(conn.execute(sa.text(
            "SELECT id FROM tasks WHERE parent_id = :r"), {"r": root}).scalars())
        done = list(conn.execute(sa.text(
            "SELECT id FROM tasks WHERE root_id = :r AND depth = 2 AND status = 'done' "
            "LIMIT 30"), {"r": root}).scalars())
    return leads, done


def fan_in_and_claims(leads: list[Any], done: list[Any],
                      big: bool) -> dict[str, tuple[dict[str, Any], int]]:
    """The hot statements with their parameters and a bound on the rows they may handle."""
    claim = {"agents": ["writer"], "worker": "w-2", "lease_seconds": 30.0, "limit": 16,
             "dry_tenants": []}
    near = (LEADS + 1) * ROWS_PER_ID  # the waiting parents and their children
    return {
        "task_flip_ready_parents": ({"ids": leads, "worker": "w-2", "quiet_agents": []}, near),
        "task_sweep_ready_parents": ({"worker": "w-2", "limit": 1000}, near),
        # In a big table, the given children alone, each found by its key (not a walk of
        # every child); in a table of one tree, reading it all is fine.
        "task_roll_up_children": ({"ids": done}, len(done) * 8 if big else near * 30),
        "task_claim_available": (claim, 931 * ROWS_PER_ID),
        "task_claim_capped": ({**claim, "cap_tenants": ["capped"], "caps": [2]},
                              931 * ROWS_PER_ID),
        "task_reap_expired": ({"worker": "w-2", "limit": 1000, "max_delivery": 5,
                               "poison_why": ""}, 931 * ROWS_PER_ID),
        "metrics_live_tasks": ({}, 931 * ROWS_PER_ID),
    }


def assert_hot_plans(store: Store, leads: list[Any], done: list[Any], big: bool) -> None:
    """No plan pairs rows through a join filter, reads the status index, or (``big``: in a
    table much larger than the tree) all of ``tasks``; each handles rows within its bound."""
    for name, (params, bound) in fan_in_and_claims(leads, done, big).items():
        plan = explain(store, name, analyze=True, **params)  # rolled back on close
        nodes = list(nodes_of(plan))
        filtered = [n["Join Filter"] for n in nodes
                    if n["Node Type"] == "Nested Loop" and "Join Filter" in n]
        assert not filtered, f"{name}: a nested loop pairs rows through a filter: {filtered}"
        seq = [n for n in nodes if n["Node Type"] == "Seq Scan"
               and n.get("Relation Name") == "tasks"]
        assert not (big and seq), f"{name} reads all of tasks"
        status_index = [n for n in nodes if n.get("Index Name") == "idx_tasks_status_agent"]
        assert not status_index, f"{name} reads the status index (dropped by migration 0020)"
        handled = rows_handled(plan)
        assert handled <= bound, f"{name} handled {handled} rows (at most {bound})"


def test_a_fresh_running_tree_among_analyzed_roots_keeps_its_fan_in_probes(
        quiet_store: Store) -> None:
    # Statistics that know only roots, all done (a queue of one-task goals): a child, a
    # waiting parent, a pending task look like about one row to the planner. The fan-in
    # then walked every child once per parent, and the roll-up filtered every child by id.
    with quiet_store.database.transaction() as conn:
        conn.execute(sa.text(
            "INSERT INTO tasks (id, root_id, to_agent, type, payload, status, completed_at) "
            "SELECT u, u, 'writer', 'work', '{}', 'done', now() "
            "FROM (SELECT gen_random_uuid() AS u FROM generate_series(1, 20000)) s"))
    with quiet_store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text("ANALYZE tasks"))
    leads, done = build_running_tree(quiet_store)
    assert_hot_plans(quiet_store, leads, done, big=True)


def test_a_fresh_running_tree_in_a_fresh_database_keeps_its_fan_in_probes(
        quiet_store: Store) -> None:
    # A table of one tree: reading all of it may be the cheapest plan, pairing rows not.
    leads, done = build_running_tree(quiet_store)
    assert_hot_plans(quiet_store, leads, done, big=False)
