"""The claim statement's latency with a small table and with a million finished rows.

The runtime's own ``task_claim_available`` statement (from ``runtime/store/queries.sql``, sent
through SQLAlchemy as the worker sends it) claims one row, ``samples`` times, each in a
transaction that is rolled back, so the queue is the same for every sample. First with
``pending`` pending rows only, then after ``finished`` rows in ``done`` were added with
``generate_series`` (and ``VACUUM ANALYZE``, as autovacuum would have done on an old
table): finished rows must not slow the claim (the partial index ``ix_tasks_claimable``
holds claimable rows only). Also prints the EXPLAIN ANALYZE plan at 1M rows. Last, with
``deep`` pending rows in all: the claim's cost as the queue gets deep; and a claim for a
second agent whose few tasks sit behind all of those (a worker serving a rare agent).

    python -m bench.claim_latency [--pending 1000] [--finished 1000000] [--samples 500]
        [--deep 20000]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import sqlalchemy as sa

from bench.common import (
    connect,
    median,
    ms,
    open_store,
    percentile,
    report,
    scratch_database,
    submit_noop,
)
from runtime.store.queries import QUERIES

CLAIM = sa.text(QUERIES["task_claim_available"])
PARAMS = {"agents": ["noop"], "worker": "bench", "lease_seconds": 30.0,
          "cap_tenants": [], "caps": [], "dry_tenants": []}
WARMUP = 20


def time_claims(engine: sa.Engine, samples: int, limit: int = 1,
                agent: str = "noop") -> list[float]:
    """Seconds per claim of ``limit`` rows for ``agent``, each rolled back."""
    times: list[float] = []
    with engine.connect() as conn:
        for i in range(WARMUP + samples):
            started = time.perf_counter()
            rows = conn.execute(CLAIM, {**PARAMS, "agents": [agent], "limit": limit}).all()
            elapsed = time.perf_counter() - started
            conn.rollback()
            if len(rows) != limit:
                raise RuntimeError(f"the claim returned {len(rows)} rows, expected {limit}")
            if i >= WARMUP:
                times.append(elapsed)
    return times


def claim_plan(engine: sa.Engine) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of one claim, rolled back."""
    explain = sa.text("EXPLAIN (ANALYZE, BUFFERS) " + QUERIES["task_claim_available"])
    with engine.connect() as conn:
        lines = [r[0] for r in conn.execute(explain, {**PARAMS, "limit": 1})]
        conn.rollback()
    return "\n".join(lines)


def add_finished(url: str, n: int) -> float:
    """Insert ``n`` finished (``done``) tasks in one statement; return the seconds it took."""
    started = time.perf_counter()
    with connect(url) as conn:
        conn.execute(
            "INSERT INTO tasks (id, root_id, to_agent, type, payload, status, priority, depth, "
            "result, verdict, created_at, started_at, claimed_at, completed_at, updated_at) "
            "SELECT u, u, 'noop', 'work', jsonb_build_object('goal', 'old ' || i), 'done', 5, 0, "
            "'{\"ok\": true}', '{\"pass\": true}', t, t, t, t + interval '1 second', "
            "t + interval '1 second' "
            "FROM (SELECT gen_random_uuid() AS u, i, "
            "      now() - interval '30 days' + i * interval '1 second' AS t "
            "      FROM generate_series(1, %s) AS i) s", (n,))
        conn.execute("VACUUM ANALYZE tasks")
    return time.perf_counter() - started


def summary(times: list[float]) -> tuple[float, float]:
    """(median ms, p95 ms)."""
    return ms(median(times)), ms(percentile(times, 95))


def measure(url: str, pending: int = 1_000, finished: int = 1_000_000,
            samples: int = 500, deep: int = 20_000) -> dict[str, Any]:
    """Claim latency with ``pending`` rows, then ``finished`` more rows in ``done``, then
    ``deep`` pending rows in all (a deep queue, as when a drain starts)."""
    store = open_store(url, pool_size=2)
    try:
        submit_noop(store, pending)
        with connect(url) as conn:
            conn.execute("VACUUM ANALYZE tasks")
        small = time_claims(store.engine, samples)
        small50 = time_claims(store.engine, max(samples // 5, 10), limit=min(50, pending))
        load_seconds = add_finished(url, finished)
        big = time_claims(store.engine, samples)
        big50 = time_claims(store.engine, max(samples // 5, 10), limit=min(50, pending))
        plan = claim_plan(store.engine)
        submit_noop(store, max(deep - pending, 0))
        with connect(url) as conn:
            conn.execute("VACUUM ANALYZE tasks")
        deep1 = time_claims(store.engine, max(samples // 5, 10))
        deep50 = time_claims(store.engine, max(samples // 5, 10), limit=50)
        deep_plan = claim_plan(store.engine)
        submit_noop(store, 10, agent="echo")  # a second agent, at the back of the queue
        rare = time_claims(store.engine, max(samples // 5, 10), agent="echo")
    finally:
        store.dispose()
    small_med, small_p95 = summary(small)
    big_med, big_p95 = summary(big)
    return {
        "claim_ms_small_table": small_med,
        "claim_p95_ms_small_table": small_p95,
        "claim50_ms_small_table": summary(small50)[0],
        "claim_ms_1m_finished": big_med,
        "claim_p95_ms_1m_finished": big_p95,
        "claim50_ms_1m_finished": summary(big50)[0],
        "claim_ms_20k_pending": summary(deep1)[0],
        "claim50_ms_20k_pending": summary(deep50)[0],
        "claim_ms_rare_agent_20k": summary(rare)[0],
        "claim_pending_rows": pending,
        "claim_deep_pending_rows": max(deep, pending),
        "claim_finished_rows": finished,
        "claim_samples": samples,
        "claim_finished_load_seconds": round(load_seconds, 1),
        "claim_plan_1m": plan,
        "claim_plan_20k_pending": deep_plan,
    }


def main(pending: int = 1_000, finished: int = 1_000_000, samples: int = 500,
         deep: int = 20_000, server: str | None = None) -> dict[str, Any]:
    """Run in a scratch database; print and return the figures."""
    with scratch_database("claim", server) as url:
        figures = measure(url, pending, finished, samples, deep)
    return report("claim latency (task_claim_available, 1 row, rolled back)", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pending", type=int, default=1_000)
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--deep", type=int, default=20_000)
    a = parser.parse_args()
    main(a.pending, a.finished, a.samples, a.deep)
