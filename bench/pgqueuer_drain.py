"""A peer measured beside us: pgqueuer draining no-op jobs on the same server.

pgqueuer (https://github.com/janbjorge/pgqueuer) is a PostgreSQL job queue for Python
built on the same ``FOR UPDATE SKIP LOCKED`` claim. Its schema is installed in a scratch
database of its own; ``n`` jobs with a no-op entrypoint are enqueued in batches, then
``procs`` processes (``bench.pgqueuer_worker``, which imports pgqueuer and asyncpg only)
each run a ``QueueManager`` in ``drain`` mode (exit when the queue is empty) with a given
dequeue ``batch_size``. The clock starts when the processes are
spawned (their start-up counts, as it does for ``bench.drain``) and stops when the last
one exits. A short sweep over settings picks pgqueuer's best on this machine; the best
is reported as ``pgqueuer_jobs_per_s``.

pgqueuer does less per job than orgchart does per task (no judge stage, no event rows,
no budgets): it is the yardstick for the queue, not a like-for-like workload.

    python -m bench.pgqueuer_drain [--n 20000] [--settings 1x5x10,2x5x100]

Needs the ``bench`` extra (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from typing import Any

from bench.common import (
    admin,
    children_cpu_seconds,
    compile_sources,
    connect,
    report,
    server_cpu_seconds,
    server_url,
    with_database,
)

#: (processes, consumers per process, dequeue batch size); pgqueuer's own drain bench
#: defaults to 1 process x 5 consumers x batch 10.
DEFAULT_GRID = ("1x5x10", "1x5x100", "2x5x100", "2x10x100")
ENQUEUE_CHUNK = 5_000


def _libpq(url: str) -> str:
    from runtime.store.postgres import urls

    return urls.libpq_url(url)


async def _connect(url: str) -> Any:
    import psycopg

    return await psycopg.AsyncConnection.connect(_libpq(url), autocommit=True)


async def install_schema(url: str) -> None:
    from pgqueuer import Queries

    conn = await _connect(url)
    try:
        await Queries.from_psycopg_connection(conn).install()
    finally:
        await conn.close()


async def _enqueue(url: str, n: int) -> None:
    from pgqueuer import Queries

    conn = await _connect(url)
    try:
        queries = Queries.from_psycopg_connection(conn)
        done = 0
        while done < n:
            size = min(ENQUEUE_CHUNK, n - done)
            await queries.enqueue(["noop"] * size, [None] * size, [0] * size)
            done += size
    finally:
        await conn.close()


def vacuum(url: str) -> None:
    """``VACUUM ANALYZE`` pgqueuer's tables, as ``bench.drain`` does ours before each trial.

    Without it a trial walks the dead rows of the trials before it: one run of 2026-12-02
    gave pgqueuer 3,776 jobs/s in its first sweep trial and 510 in its final one (3.6 ms of
    server CPU a job), while the paired rounds of ``bench.drain_pair`` gave 7,700 to 10,858.
    """
    with connect(url) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE tablename LIKE 'pgqueuer%'")]
        for table in tables:
            conn.execute(f'VACUUM ANALYZE "{table}"')  # type: ignore[arg-type]


async def _remaining(url: str) -> int:
    conn = await _connect(url)
    try:
        cur = await conn.execute("SELECT count(*) FROM pgqueuer")
        row = await cur.fetchone()
        return int(row[0]) if row else 0
    finally:
        await conn.close()


def trial(url: str, n: int, procs: int, consumers: int, batch_size: int
          ) -> tuple[float, float, float | None]:
    """Enqueue ``n`` jobs, drain them with ``procs`` processes.

    Returns jobs per second, and the CPU per job (ms) of the pgqueuer processes and of the
    PostgreSQL server (None when it does not run on this machine).
    """
    asyncio.run(_enqueue(url, n))
    vacuum(url)
    compile_sources()
    workers_cpu0, server_cpu0 = children_cpu_seconds(), server_cpu_seconds(url)
    started = time.perf_counter()
    # bench.pgqueuer_worker imports pgqueuer and asyncpg only (its module doc says why).
    workers = [subprocess.Popen([sys.executable, "-m", "bench.pgqueuer_worker", _libpq(url),
                                 "--consumers", str(consumers), "--batch-size", str(batch_size)])
               for _ in range(procs)]
    for proc in workers:
        proc.wait(timeout=600)
    elapsed = time.perf_counter() - started
    workers_cpu1, server_cpu1 = children_cpu_seconds(), server_cpu_seconds(url)
    left = asyncio.run(_remaining(url))
    if left:
        raise RuntimeError(f"pgqueuer left {left} jobs undrained")
    server_ms = (None if server_cpu0 is None or server_cpu1 is None
                 else (server_cpu1 - server_cpu0) / n * 1000)
    return n / elapsed, (workers_cpu1 - workers_cpu0) / n * 1000, server_ms


def main(n: int = 20_000, sweep_n: int = 10_000, server: str | None = None,
         grid: tuple[str, ...] = DEFAULT_GRID) -> dict[str, Any]:
    """Sweep pgqueuer's settings on a smaller queue, then drain ``n`` jobs with the best."""
    server = server or server_url()
    name = f"bench_pgqueuer_{int(time.time())}"
    admin(server, f'CREATE DATABASE "{name}"')
    url = with_database(server, name)
    try:
        asyncio.run(install_schema(url))
        sweep: dict[str, float] = {}
        for setting in grid:
            procs, consumers, batch = (int(x) for x in setting.split("x"))
            sweep[setting] = round(trial(url, sweep_n, procs, consumers, batch)[0], 1)
        best = max(sweep, key=lambda k: sweep[k])
        procs, consumers, batch = (int(x) for x in best.split("x"))
        rate, cpu_ms, server_ms = trial(url, n, procs, consumers, batch)
    finally:
        admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return report("pgqueuer_drain", {
        "pgqueuer_jobs_per_s": round(rate, 1),
        "pgqueuer_best_setting": f"{procs} processes x {consumers} consumers x batch {batch}",
        "pgqueuer_sweep_jobs_per_s": sweep,
        "pgqueuer_cpu_ms_per_job": round(cpu_ms, 4),
        "pgqueuer_postgres_cpu_ms_per_job": None if server_ms is None else round(server_ms, 4),
        "n": n,
        "pgqueuer_jobs": n,
    })


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--sweep-n", type=int, default=10_000)
    parser.add_argument("--settings", default=",".join(DEFAULT_GRID))
    args = parser.parse_args()
    main(args.n, args.sweep_n, grid=tuple(args.settings.split(",")))
