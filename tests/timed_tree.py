"""A finished tree written straight into the database with realistic timestamps.

planner -> ``leads`` leads -> ``writers`` writers each: every task has its
``task_events`` (submitted, claimed, delegated, fan-in, aggregate, judged, done) at
plausible times and one ``model_calls`` row per run, so timelines, critical paths and
traces can be checked against known numbers. The slowest lead is ``lead-{slow_lead}``
and its slowest writer is the last one: that chain is the critical path.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from runtime.store.store import Store

_TASK = sa.text(
    "INSERT INTO tasks (id, parent_id, root_id, from_agent, to_agent, type, payload, status, "
    "depth, result, verdict, own_tokens, own_usd, spent_tokens, spent_usd, duration_seconds, "
    "idempotency_key, created_at, started_at, completed_at, delivery_count, route, model) "
    "VALUES (:id, :parent_id, :root_id, :from_agent, :agent, 'task', "
    "CAST(:payload AS jsonb), 'done', :depth, CAST('{\"ok\": true}' AS jsonb), "
    "CAST('{\"passed\": true, \"score\": 0.9}' AS jsonb), :tokens, :usd, :tokens, :usd, "
    ":duration, :key, :created, :started, :completed, 1, 'local', 'qwen3:0.6b')")
_EVENT = sa.text(
    "INSERT INTO task_events (task_id, from_status, to_status, at, worker, detail) "
    "VALUES (:task_id, :from_status, :to_status, :at, 'w-test', :detail)")
_CALL = sa.text(
    "INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, model, "
    "prompt, response, prompt_tokens, completion_tokens, duration_seconds, cost_usd, "
    "created_at) SELECT :task_id, t.root_id, 1, 0, 'ollama', 'local', 'qwen3:0.6b', 'prompt', "
    "'{}', :pt, :ct, :duration, :usd, :at FROM tasks t WHERE t.id = :task_id")


@dataclass
class TimedTree:
    """What was written: the root id, every task id by name, the expected numbers."""

    root: uuid.UUID
    ids: dict[str, uuid.UUID] = field(default_factory=dict)
    parents: dict[uuid.UUID, uuid.UUID | None] = field(default_factory=dict)
    critical: list[uuid.UUID] = field(default_factory=list)
    calls: int = 0
    t0: dt.datetime = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    end: dt.datetime = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def build_timed_tree(store: Store, leads: int = 30, writers: int = 30, slow_lead: int = 7,
                     seed: int = 1) -> TimedTree:
    """Write planner -> leads -> writers, all done, with events and model calls."""
    rnd = random.Random(seed)
    t0 = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(minutes=5)
    s = dt.timedelta(seconds=1)
    root = uuid.uuid4()
    tree = TimedTree(root=root, t0=t0)
    tasks: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []

    def task(name: str, parent: uuid.UUID | None, agent: str, depth: int,
             created: dt.datetime, timeline: list[tuple[str, dt.datetime]],
             call: tuple[dt.datetime, float] | None) -> uuid.UUID:
        tid = root if parent is None else uuid.uuid4()
        tree.ids[name] = tid
        tree.parents[tid] = parent
        started = timeline[0][1]
        completed = timeline[-1][1]
        tasks.append({"id": tid, "parent_id": parent, "root_id": root,
                      "from_agent": None if parent is None else "x", "agent": agent,
                      "payload": json.dumps({"goal": name}), "depth": depth, "tokens": 120,
                      "usd": 0.0012, "duration": (completed - started).total_seconds(),
                      "key": None if parent is None else name, "created": created,
                      "started": started, "completed": completed})
        prev: str | None = None
        for status, at in [("pending", created), *timeline]:
            events.append({"task_id": tid, "from_status": prev, "to_status": status, "at": at,
                           "detail": "submitted" if prev is None else None})
            prev = status
        if call is not None:
            end, seconds = call
            calls.append({"task_id": tid, "pt": 100, "ct": 20, "duration": seconds,
                          "usd": 0.0012, "at": end})
        return tid

    # Times are decided bottom-up, then written in one go.
    planner_claim = t0 + 0.05 * s
    planner_delegate = planner_claim + 0.2 * s
    lead_done: list[tuple[dt.datetime, str, list[Any]]] = []
    for i in range(leads):
        created = planner_delegate
        claim = created + (0.02 + 0.01 * i) * s
        delegate = claim + 0.1 * s
        kids = []
        last_writer = delegate
        for j in range(writers):
            w_claim = delegate + (0.01 + 0.01 * rnd.random()) * s
            run = 1.0 + 0.4 * rnd.random()
            if i == slow_lead and j == writers - 1:
                run = 1.6  # the slowest writer of the slowest lead
            w_run_end = w_claim + run * s
            w_done = w_run_end + 0.05 * s
            kids.append((f"writer-{i}-{j}", delegate, w_claim, w_run_end, w_done, run))
            last_writer = max(last_writer, w_done)
        ready = last_writer + 0.01 * s
        agg = ready + (0.3 if i == slow_lead else 0.02) * s
        agg_end = agg + 0.1 * s
        done = agg_end + 0.05 * s
        lead_done.append((done, f"lead-{i}", [created, claim, delegate, ready, agg, agg_end,
                                              kids]))
    last_lead = max(d for d, _, _ in lead_done)
    p_ready = last_lead + 0.01 * s
    p_agg = p_ready + 0.05 * s
    p_agg_end = p_agg + 0.2 * s
    p_done = p_agg_end + 0.05 * s
    task("planner", None, "planner", 0, t0,
         [("running", planner_claim), ("waiting", planner_delegate), ("ready_to_aggregate",
          p_ready), ("running", p_agg), ("judging", p_agg_end), ("done", p_done)],
         (planner_delegate, 0.18))
    for _done, name, (created, claim, delegate, ready, agg, agg_end, kids) in lead_done:
        lid = task(name, root, "lead", 1, created,
                   [("running", claim), ("waiting", delegate), ("ready_to_aggregate", ready),
                    ("running", agg), ("judging", agg_end), ("done", _done)],
                   (delegate, 0.08))
        for wname, w_created, w_claim, w_run_end, w_done, run in kids:
            task(wname, lid, "wide_writer", 2, w_created,
                 [("running", w_claim), ("judging", w_run_end), ("done", w_done)],
                 (w_run_end, run - 0.02))
    tree.calls = len(calls)
    tree.end = p_done
    if slow_lead < leads:
        tree.critical = [root, tree.ids[f"lead-{slow_lead}"],
                         tree.ids[f"writer-{slow_lead}-{writers - 1}"]]
    with store.database.transaction() as conn:
        conn.execute(_TASK, tasks)
        conn.execute(_EVENT, events)
        conn.execute(_CALL, calls)
    return tree
