"""The raw-SQL reference: how fast this server claims and finishes tasks with no runtime.

A copy of the ``tasks`` table (``CREATE TABLE ref_tasks (LIKE tasks INCLUDING ALL)``: same
columns, defaults, constraints and indexes) holds ``n`` pending rows. ``threads`` threads,
each on its own psycopg connection in autocommit, loop: claim one row (``FOR UPDATE SKIP
LOCKED``, one statement), mark it done (one statement). No events, no judge, no
notifications: the floor any runtime on this server is measured against. The batched
variant claims and finishes ``batch`` rows per statement (context: what batching buys).

    python -m bench.reference [--tasks 20000] [--threads 4]
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from bench.common import connect, report, scratch_database, server_cpu_seconds

CLAIM_ONE = """
UPDATE ref_tasks t
SET status = 'running', lease_owner = %(worker)s, lease_token = gen_random_uuid(),
    lease_expires_at = now() + interval '30 seconds', claimed_at = now(),
    started_at = COALESCE(t.started_at, now()), delivery_count = t.delivery_count + 1,
    updated_at = now()
WHERE t.id = (
    SELECT id FROM ref_tasks
    WHERE status = 'pending' AND to_agent = 'noop' AND available_at <= now()
    ORDER BY priority, created_at
    LIMIT 1
    FOR UPDATE SKIP LOCKED)
RETURNING t.id, t.lease_token
"""

DONE_ONE = """
UPDATE ref_tasks
SET status = 'done', result = '{"ok": true}', lease_owner = NULL, lease_token = NULL,
    lease_expires_at = NULL, completed_at = now(), updated_at = now()
WHERE id = %(id)s AND lease_token = %(token)s
"""

CLAIM_MANY = """
WITH picked AS (
    SELECT id FROM ref_tasks
    WHERE status = 'pending' AND to_agent = 'noop' AND available_at <= now()
    ORDER BY priority, created_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED)
UPDATE ref_tasks t
SET status = 'running', lease_owner = %(worker)s, lease_token = gen_random_uuid(),
    lease_expires_at = now() + interval '30 seconds', claimed_at = now(),
    started_at = COALESCE(t.started_at, now()), delivery_count = t.delivery_count + 1,
    updated_at = now()
FROM picked p WHERE t.id = p.id
RETURNING t.id, t.lease_token
"""

DONE_MANY = """
UPDATE ref_tasks t
SET status = 'done', result = '{"ok": true}', lease_owner = NULL, lease_token = NULL,
    lease_expires_at = NULL, completed_at = now(), updated_at = now()
FROM unnest(%(ids)s::uuid[], %(tokens)s::uuid[]) AS i(id, token)
WHERE t.id = i.id AND t.lease_token = i.token
"""


def create_reference_table(url: str, n: int) -> None:
    """(Re)create ``ref_tasks`` as a copy of ``tasks`` and fill it with ``n`` pending rows."""
    with connect(url) as conn:
        conn.execute("DROP TABLE IF EXISTS ref_tasks")
        conn.execute("CREATE TABLE ref_tasks (LIKE tasks INCLUDING ALL)")
        conn.execute(
            "INSERT INTO ref_tasks (id, root_id, to_agent, type, payload, priority, depth) "
            "SELECT u, u, 'noop', 'work', jsonb_build_object('goal', 'bench ' || i), 5, 0 "
            "FROM (SELECT gen_random_uuid() AS u, i FROM generate_series(1, %s) AS i) s", (n,))
        conn.execute("VACUUM ANALYZE ref_tasks")


def _loop_one(url: str, name: str, start: threading.Barrier, counts: list[int],
              index: int) -> None:
    with connect(url) as conn:
        start.wait()
        done = 0
        while True:
            row = conn.execute(CLAIM_ONE, {"worker": name}).fetchone()
            if row is None:
                break
            conn.execute(DONE_ONE, {"id": row[0], "token": row[1]})
            done += 1
        counts[index] = done


def _loop_many(url: str, name: str, batch: int, start: threading.Barrier, counts: list[int],
               index: int) -> None:
    with connect(url) as conn:
        start.wait()
        done = 0
        while True:
            rows = conn.execute(CLAIM_MANY, {"worker": name, "limit": batch}).fetchall()
            if not rows:
                break
            conn.execute(DONE_MANY, {"ids": [r[0] for r in rows], "tokens": [r[1] for r in rows]})
            done += len(rows)
        counts[index] = done


def run_loop(url: str, n: int, threads: int, batch: int = 1) -> dict[str, Any]:
    """Drain ``n`` reference rows with ``threads`` threads, ``batch`` rows per statement."""
    create_reference_table(url, n)
    counts = [0] * threads
    barrier = threading.Barrier(threads + 1)
    workers = []
    for i in range(threads):
        args: tuple[Any, ...] = ((url, f"ref-{i}", barrier, counts, i) if batch == 1
                                 else (url, f"ref-{i}", batch, barrier, counts, i))
        target = _loop_one if batch == 1 else _loop_many
        workers.append(threading.Thread(target=target, args=args, daemon=True))
    for t in workers:
        t.start()
    server_cpu0 = server_cpu_seconds(url)
    barrier.wait()
    started, client_cpu0 = time.perf_counter(), time.process_time()
    for t in workers:
        t.join()
    elapsed, client_cpu = time.perf_counter() - started, time.process_time() - client_cpu0
    server_cpu1 = server_cpu_seconds(url)
    total = sum(counts)
    if total != n:
        raise RuntimeError(f"reference loop finished {total} of {n} rows")
    server_cpu = (None if server_cpu0 is None or server_cpu1 is None
                  else round((server_cpu1 - server_cpu0) / n * 1000, 4))
    return {"tasks": total, "seconds": round(elapsed, 3), "tasks_per_s": round(total / elapsed, 1),
            "client_cpu_ms_per_task": round(client_cpu / n * 1000, 4),
            "postgres_cpu_ms_per_task": server_cpu}


def measure(url: str, n: int = 20_000, threads: int = 4, batch: int = 50) -> dict[str, Any]:
    """The unbatched reference and the batched one, on the database at ``url``."""
    one = run_loop(url, n, threads)
    many = run_loop(url, n, threads, batch)
    with connect(url) as conn:
        conn.execute("DROP TABLE ref_tasks")
    return {
        "reference_tasks_per_s": one["tasks_per_s"],
        "reference_seconds": one["seconds"],
        "reference_tasks": n,
        "reference_threads": threads,
        "reference_client_cpu_ms_per_task": one["client_cpu_ms_per_task"],
        "reference_postgres_cpu_ms_per_task": one["postgres_cpu_ms_per_task"],
        "reference_batched_tasks_per_s": many["tasks_per_s"],
        "reference_batch_size": batch,
    }


def main(n: int = 20_000, threads: int = 4, batch: int = 50,
         server: str | None = None) -> dict[str, Any]:
    """Run the reference in a scratch database; print and return its figures."""
    with scratch_database("reference", server) as url:
        figures = measure(url, n, threads, batch)
    return report("reference (raw SQL, claim one + done one, no events)", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=50)
    a = parser.parse_args()
    main(a.tasks, a.threads, a.batch)
