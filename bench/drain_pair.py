"""Our drain at the defaults and pgqueuer's, in alternating rounds on the same server.

``bench.drain`` and ``bench.pgqueuer_drain`` each drain their queue once at the end of
their sweep, minutes apart; on a shared two-core machine the rate of one setting moves
by 20% or more from one minute to the next (the same ``1xdefault`` gave 6,473 and 5,071
tasks/s in one sweep). This benchmark pairs them instead: each round drains ``n`` noop
tasks with one ``orgchart worker`` at the ``[worker]`` defaults, then ``n`` tasks of the
``async_noop`` agent the same way, then ``n`` pgqueuer jobs with pgqueuer's setting (its
usual best here, 1 process x 5 consumers x batch 100), and the ratios of each round are
taken. The median ratio is the figure; every round is kept. ``ratio`` is the plain ``def
run`` no-op's (a worker runs those on its agent threads: a hand-off to a thread and back
per task); ``async_ratio`` the ``async def run`` no-op's, awaited on the worker's loop:
like for like with pgqueuer's job, an ``async def`` on its loop.
Start-up counts on both sides, and the CPU per task of both sides' processes and of
PostgreSQL is reported beside each rate.

    python -m bench.drain_pair [--n 20000] [--rounds 4] [--pgqueuer 1x5x100]

Needs the ``bench`` extra (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from bench import drain, pgqueuer_drain
from bench.common import admin, report, scratch_database, server_url, with_database

#: pgqueuer's setting: (processes, consumers per process, dequeue batch size).
PGQUEUER_SETTING = "1x5x100"


def _round(url: str, pgq_url: str, n: int, pgq: tuple[int, int, int]) -> dict[str, Any]:
    """One round: our drains at the defaults (plain and async no-op), then pgqueuer's."""
    ours = drain.trial(url, n, drain.Setting(1, None, None))
    ours_async = drain.trial(url, n, drain.Setting(1, None, None), agent="async_noop")
    rate, cpu_ms, server_ms = pgqueuer_drain.trial(pgq_url, n, *pgq)
    rate = round(rate, 1)  # the ratio is of the two figures as reported
    return {
        "orgchart_tasks_per_s": ours["tasks_per_s"],
        "orgchart_tasks_per_s_after_startup": ours["tasks_per_s_after_startup"],
        "orgchart_worker_cpu_ms_per_task": ours["worker_cpu_ms_per_task"],
        "orgchart_postgres_cpu_ms_per_task": ours["postgres_cpu_ms_per_task"],
        "pgqueuer_jobs_per_s": rate,
        "pgqueuer_cpu_ms_per_job": round(cpu_ms, 4),
        "pgqueuer_postgres_cpu_ms_per_job": None if server_ms is None else round(server_ms, 4),
        "ratio": round(ours["tasks_per_s"] / rate, 3),
        "orgchart_async_tasks_per_s": ours_async["tasks_per_s"],
        "orgchart_async_worker_cpu_ms_per_task": ours_async["worker_cpu_ms_per_task"],
        "orgchart_async_postgres_cpu_ms_per_task": ours_async["postgres_cpu_ms_per_task"],
        "async_ratio": round(ours_async["tasks_per_s"] / rate, 3),
    }


def main(n: int = 20_000, rounds: int = 4, pgqueuer: str = PGQUEUER_SETTING,
         server: str | None = None) -> dict[str, Any]:
    """Run ``rounds`` paired drains of ``n`` tasks; print and return the figures."""
    server = server or server_url()
    try:
        procs, consumers, batch = (int(x) for x in pgqueuer.lower().split("x"))
    except ValueError:
        raise ValueError(f"cannot read pgqueuer setting {pgqueuer!r}: use "
                         "PROCSxCONSUMERSxBATCH (for example 1x5x100)") from None
    if rounds < 1 or n < 1:
        raise ValueError("--rounds and --n must be at least 1")
    name = f"bench_pgqueuer_pair_{int(time.time())}"
    admin(server, f'CREATE DATABASE "{name}"')
    pgq_url = with_database(server, name)
    kept: list[dict[str, Any]] = []
    try:
        asyncio.run(pgqueuer_drain.install_schema(pgq_url))
        with scratch_database("drain_pair", server) as url:
            for i in range(rounds):
                kept.append(_round(url, pgq_url, n, (procs, consumers, batch)))
                r = kept[-1]
                print(f"  round {i + 1}: orgchart {r['orgchart_tasks_per_s']:.0f}/s (async "
                      f"{r['orgchart_async_tasks_per_s']:.0f}/s), pgqueuer "
                      f"{r['pgqueuer_jobs_per_s']:.0f}/s, ratio {r['ratio']:.2f} (async "
                      f"{r['async_ratio']:.2f})", flush=True)
    finally:
        admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def med(key: str) -> float | None:
        values = [r[key] for r in kept if r[key] is not None]
        return round(statistics.median(values), 4) if values else None

    return report(f"drain_pair ({rounds} rounds of {n} tasks: defaults against pgqueuer "
                  f"{pgqueuer})", {
        "drain_pair_ratio_median": med("ratio"),
        "drain_pair_ratio_min": min(r["ratio"] for r in kept),
        "drain_pair_ratio_max": max(r["ratio"] for r in kept),
        "drain_pair_async_ratio_median": med("async_ratio"),
        "drain_pair_async_ratio_min": min(r["async_ratio"] for r in kept),
        "drain_pair_async_ratio_max": max(r["async_ratio"] for r in kept),
        "drain_pair_orgchart_async_tasks_per_s_median": med("orgchart_async_tasks_per_s"),
        "drain_pair_orgchart_tasks_per_s_median": med("orgchart_tasks_per_s"),
        "drain_pair_pgqueuer_jobs_per_s_median": med("pgqueuer_jobs_per_s"),
        "drain_pair_cpu_ms_per_task_median": {
            "orgchart_worker": med("orgchart_worker_cpu_ms_per_task"),
            "orgchart_postgres": med("orgchart_postgres_cpu_ms_per_task"),
            "orgchart_async_worker": med("orgchart_async_worker_cpu_ms_per_task"),
            "orgchart_async_postgres": med("orgchart_async_postgres_cpu_ms_per_task"),
            "pgqueuer_worker": med("pgqueuer_cpu_ms_per_job"),
            "pgqueuer_postgres": med("pgqueuer_postgres_cpu_ms_per_job")},
        "drain_pair_tasks": n,
        "drain_pair_pgqueuer_setting": pgqueuer,
        "drain_pair_rounds": kept,
    })


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pgqueuer", default=PGQUEUER_SETTING,
                        help="pgqueuer's PROCSxCONSUMERSxBATCH")
    a = parser.parse_args()
    main(a.n, a.rounds, a.pgqueuer)
