"""The audit's own cost: ``checker_seconds_per_100k_events`` (issue 40; goal <= 10 s).

Builds a large, legal history in a scratch database with ``generate_series``: ``trees``
trees of a root and ``children`` children, each task with its events (a root: submitted,
claimed, waiting, fan-in, claimed for its aggregate, done; a child: delegated, claimed,
done; each delivery's claim and outcome under its lease token), a paid model call per
task inside its lease, carved budgets. Then times
:func:`runtime.audit.checker.audit` over the whole database (every check, read in its
bounded batches), and prints the figures. The checker must find no violation here.

    python -m bench.audit [--events 200000] [--children 9] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from bench.common import connect, median, open_store, report, scratch_database
from runtime.audit.checker import audit

#: Events per tree: a root's six and three per child.
ROOT_EVENTS, CHILD_EVENTS = 6, 3

_BUILD = [
    """CREATE TEMP TABLE r AS
       SELECT g, gen_random_uuid() AS id,
              timestamptz '2026-01-01' + g * interval '20 ms' AS t0,
              gen_random_uuid() AS run_token, gen_random_uuid() AS aggregate_token
       FROM generate_series(1, %(trees)s) g""",
    """CREATE TEMP TABLE c AS
       SELECT r.id AS root, r.t0, k, gen_random_uuid() AS id, gen_random_uuid() AS token
       FROM r, generate_series(1, %(children)s) k""",
    """INSERT INTO tasks (id, root_id, to_agent, type, payload, status, depth, budget_tokens,
                          budget_usd, created_at, idempotency_key)
       SELECT id, id, 'lead', 'work', '{}', 'done', 0, 50000, 1.0, t0, 'k' || g FROM r""",
    """INSERT INTO tasks (id, parent_id, root_id, to_agent, type, payload, status, depth,
                          budget_tokens, budget_usd, created_at, idempotency_key)
       SELECT id, root, root, 'writer', 'work', '{}', 'done', 1, 5000, 0.1,
              t0 + interval '2 ms', 'c' || k FROM c""",
    # The roots' first three events, then the children's, then the roots' last three:
    # the fan-in comes after every child's end, in event order as in time.
    """INSERT INTO task_events (task_id, from_status, to_status, at, worker, detail,
                                lease_token)
       SELECT id, f, t, t0 + s * interval '1 ms', w, d, CASE WHEN leased THEN run_token END
       FROM r,
       (VALUES (0, NULL, 'pending', 'submit', 'submitted', false),
               (1, 'pending', 'running', 'w1', 'claimed for run, delivery 1', true),
               (2, 'running', 'waiting', 'w1', 'delegated', true)) v(s, f, t, w, d, leased)
       ORDER BY g, s""",
    """INSERT INTO task_events (task_id, from_status, to_status, at, worker, detail,
                                lease_token)
       SELECT id, f, t, t0 + s * interval '1 ms', w, d, CASE WHEN leased THEN token END
       FROM c,
       (VALUES (2, NULL, 'pending', 'w1', 'delegated by parent', false),
               (3, 'pending', 'running', 'w2', 'claimed for run, delivery 1', true),
               (5, 'running', 'done', 'w2', 'verdict: done', true)) v(s, f, t, w, d, leased)
       ORDER BY root, k, s""",
    """INSERT INTO task_events (task_id, from_status, to_status, at, worker, detail,
                                lease_token)
       SELECT id, f, t, t0 + s * interval '1 ms', w, d,
              CASE WHEN leased THEN aggregate_token END
       FROM r,
       (VALUES (6, 'waiting', 'ready_to_aggregate', 'w2', 'fan-in: last child finished', false),
               (7, 'ready_to_aggregate', 'running', 'w1', 'claimed for aggregate, delivery 1',
                true),
               (9, 'running', 'done', 'w1', 'verdict: done', true)) v(s, f, t, w, d, leased)
       ORDER BY g, s""",
    """INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, model,
                                prompt, response, prompt_tokens, completion_tokens,
                                duration_seconds, cost_usd, phase, position, request_hash,
                                created_at)
       SELECT id, root, 1, 0, 'offline', 'local', 'm', 'p', 'r', 10, 5, 0.0005, 0.0001,
              'run', '0', md5(id::text), t0 + interval '4 ms' FROM c
       UNION ALL
       SELECT id, id, 1, 0, 'offline', 'local', 'm', 'p', 'r', 10, 5, 0.0005, 0.0001,
              'aggregate', '0', md5(id::text), t0 + interval '8 ms' FROM r""",
    "ANALYZE tasks, task_events, model_calls",
]


def build(url: str, trees: int, children: int) -> dict[str, int]:
    """Fill the scratch database; return how many tasks, events and calls it holds."""
    with connect(url, autocommit=False) as conn:
        for sql in _BUILD[:-1]:
            conn.execute(sql, {"trees": trees, "children": children})  # type: ignore[arg-type]
        conn.commit()
    with connect(url) as conn:
        conn.execute(_BUILD[-1])  # type: ignore[arg-type]
        row = conn.execute("SELECT (SELECT count(*) FROM tasks), (SELECT count(*) FROM "
                           "task_events), (SELECT count(*) FROM model_calls)").fetchone()
    assert row is not None
    return {"tasks": int(row[0]), "events": int(row[1]), "calls": int(row[2])}


def main(events: int = 200_000, children: int = 9, repeats: int = 3,
         server: str | None = None) -> dict[str, Any]:
    """Build about ``events`` events and time the checker ``repeats`` times."""
    trees = max(1, events // (ROOT_EVENTS + CHILD_EVENTS * children))
    with scratch_database("audit", server) as url:
        sizes = build(url, trees, children)
        store = open_store(url)
        try:
            times, cpu, found = [], [], 0
            for _ in range(repeats):
                started, used = time.perf_counter(), time.process_time()
                result = audit(store)
                times.append(time.perf_counter() - started)
                cpu.append(time.process_time() - used)
                found = len(result.violations)
        finally:
            store.dispose()
    seconds = median(times)
    return report("audit (the checker over a legal history)", {
        "audit_trees": trees, **{f"audit_{k}": n for k, n in sizes.items()},
        "audit_repeats": repeats,
        "checker_seconds": round(seconds, 3),
        "checker_seconds_per_100k_events": round(seconds / sizes["events"] * 100_000, 3),
        # The checker's own process (the server's reads aside): what a loaded machine's
        # wall clock hides.
        "checker_cpu_seconds_per_100k_events": round(median(cpu) / sizes["events"] * 100_000,
                                                     3),
        "audit_load_average_1m": round(os.getloadavg()[0], 1),
        "audit_violations": found,
    })


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--children", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    main(args.events, args.children, args.repeats)
