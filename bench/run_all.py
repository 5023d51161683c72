"""Run every benchmark against one server and write ``bench/results/latest.json``.

    python -m bench.run_all [--out PATH] [--only drain,reference] [--quick]

The server is ``ORGCHART_DATABASE_URL`` (else the embedded PostgreSQL); each benchmark
works in a scratch database of its own. The raw-SQL reference runs right before the
drain and again right after it, on the same server; ``drain_vs_reference`` divides the
drain by the mean of the two, so the ratio survives a noisy machine.
``--quick`` uses toy sizes (a check that everything runs, not a measurement).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import (
    audit,
    charge,
    claim_latency,
    control,
    drain,
    drain_pair,
    drain_parts,
    embedded,
    experiments,
    fairness,
    fanin,
    fork,
    ha,
    makespan,
    pgqueuer_drain,
    pickup,
    reference,
    schedules,
    scrape,
    sync_agents,
    tools,
    transport,
    tree_read,
    webhooks,
    worker_memory,
)
from bench.common import RESULTS_DIR, machine, server_url
from bench.peers import run as peers

ORDER = ("reference", "drain", "pgqueuer", "drain_pair", "drain_parts", "pickup", "fanin",
         "claim_latency", "tree_read", "scrape", "worker_memory", "makespan", "sync_agents",
         "fork", "charge", "transport", "ha", "control", "tools", "fairness", "experiments",
         "audit", "webhooks", "webhooks_chaos", "schedules", "embedded", "peers")

FULL: dict[str, dict[str, Any]] = {
    "reference": {"n": 20_000, "threads": 4},
    "drain": {"n": 20_000, "sweep_n": 10_000},
    "pgqueuer": {"n": 20_000, "sweep_n": 10_000},
    "drain_pair": {"n": 20_000, "rounds": 4},
    "drain_parts": {"n": 20_000},
    "pickup": {"samples": 50},
    "fanin": {"children": 10_000, "repeats": 5},
    "claim_latency": {"pending": 1_000, "finished": 1_000_000, "samples": 500},
    "tree_read": {"nodes": 10_101, "repeats": 7},
    "scrape": {"finished": 1_000_000, "repeats": 9},
    "worker_memory": {"n": 20_000},
    "makespan": {"leads": 30, "writers": 30, "delay": 1.0, "wide_leads": 40},
    "sync_agents": {"leads": 30, "writers": 30, "delay": 1.0, "rounds": 2},
    "fork": {"leads": 30, "writers": 30, "delay": 1.0},
    "charge": {"leaves": 1000, "threads": 64, "charges": 10_000},
    "transport": {"calls": 900, "seq": 300, "rounds": 2, "delay": 0.5},
    "ha": {},
    "control": {"leads": 30, "writers": 30, "delay": 1.0, "answers": 20, "in_flight": 300},
    "tools": {"samples": 200, "rounds": 5, "crash": True},
    "fairness": {"wide": 2000, "delay": 0.2, "window": 30.0, "share_writers": 2025,
                 "limit_writers": 200},
    "experiments": {"cases": 20, "delay": 0.05},
    "audit": {"events": 200_000, "repeats": 3},
    "webhooks": {"trees": 1000, "rate": 200.0},
    "webhooks_chaos": {"trees": 1000, "chaos": True},
    "embedded": {"samples": 8, "loads": 3},  # skipped, saying so, without the extra
    "schedules": {"seconds": 60.0, "kill_every": 10.0, "workers": 3},
    "peers": {},  # each peer skipped, saying so, without the bench extra
}

QUICK: dict[str, dict[str, Any]] = {
    "reference": {"n": 200, "threads": 4},
    "drain": {"n": 200, "sweep_n": 100, "grid": ("1x8x50",)},
    "pgqueuer": {"n": 200, "sweep_n": 100, "grid": ("1x5x10",)},
    "drain_pair": {"n": 100, "rounds": 1},
    "drain_parts": {"n": 200},
    "pickup": {"samples": 3},
    "fanin": {"children": 200, "repeats": 2, "batch": 50, "last_batch": 20},
    "claim_latency": {"pending": 200, "finished": 2_000, "samples": 20, "deep": 500},
    "tree_read": {"nodes": 200, "repeats": 2},
    "scrape": {"finished": 2_000, "repeats": 2},
    "worker_memory": {"n": 200},
    "makespan": {"leads": 2, "writers": 3, "delay": 0.1, "wide_leads": 3},
    "sync_agents": {"leads": 2, "writers": 3, "delay": 0.1, "rounds": 1},
    "fork": {"leads": 2, "writers": 3, "delay": 0.1},
    "charge": {"leaves": 20, "threads": 4, "charges": 40, "calls_per_leaf": 2},
    "transport": {"calls": 20, "seq": 10, "rounds": 1, "delay": 0.05},
    "ha": {"quick": True},
    "control": {"leads": 2, "writers": 5, "delay": 0.5, "answers": 2, "in_flight": 5},
    "tools": {"samples": 3, "rounds": 2, "crash": False},
    "fairness": {"wide": 90, "delay": 0.05, "window": 3.0, "share_writers": 900,
                 "limit_writers": 20},
    "experiments": {"cases": 2, "delay": 0.01},
    "audit": {"events": 2_000, "repeats": 1},
    "webhooks": {"trees": 20, "rate": 200.0},
    "webhooks_chaos": {"trees": 20, "chaos": True},
    "embedded": {"samples": 1, "loads": 1, "tree": False},
    "schedules": {"seconds": 4.0, "kill_every": 2.0, "workers": 1},
    "peers": {"leads": 2, "writers": 3, "delay": 0.1, "depth": 3, "crash": False},
}

MAINS: dict[str, Callable[..., dict[str, Any]]] = {
    "reference": reference.main,
    "drain": drain.main,
    "pgqueuer": pgqueuer_drain.main,
    "drain_pair": drain_pair.main,
    "drain_parts": drain_parts.main,
    "pickup": pickup.main,
    "fanin": fanin.main,
    "claim_latency": claim_latency.main,
    "tree_read": tree_read.main,
    "scrape": scrape.main,
    "worker_memory": worker_memory.main,
    "makespan": makespan.main,
    "sync_agents": sync_agents.main,
    "fork": fork.main,
    "charge": charge.main,
    "transport": transport.main,
    "ha": ha.main,
    "control": control.main,
    "tools": tools.main,
    "fairness": fairness.main,
    "experiments": experiments.main,
    "audit": audit.main,
    "webhooks": webhooks.main,
    "webhooks_chaos": webhooks.main,
    "embedded": embedded.main,
    "schedules": schedules.main,
    "peers": peers.main,
}


def run(only: tuple[str, ...] = ORDER, quick: bool = False,
        server: str | None = None) -> dict[str, Any]:
    """Run the benchmarks named in ``only`` (in the standard order); return latest.json's body."""
    unknown = [name for name in only if name not in MAINS]
    if unknown:
        raise ValueError(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(ORDER)}")
    server = server or server_url()
    sizes = QUICK if quick else FULL
    out: dict[str, Any] = {
        "ts": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(server),
        "quick": quick,
    }
    durations: dict[str, float] = {}
    started = time.perf_counter()
    for name in ORDER:
        if name not in only:
            continue
        kwargs = dict(sizes[name])
        if name == "worker_memory" and "drain_settings" in out:  # the drain's best setting
            kwargs.update(sync_threads=out["drain_settings"]["sync_threads"],
                          batch_size=out["drain_settings"]["batch_size"])
        t0 = time.perf_counter()
        out.update(MAINS[name](server=server, **kwargs))
        if name == "drain" and "reference_tasks_per_s" in out:  # the reference again
            again = reference.main(server=server, **sizes["reference"])
            out["reference_after_drain_tasks_per_s"] = again["reference_tasks_per_s"]
        durations[name] = round(time.perf_counter() - t0, 1)
    if "drain_tasks_per_s" in out and "reference_tasks_per_s" in out:
        ref = (out["reference_tasks_per_s"] + out["reference_after_drain_tasks_per_s"]) / 2
        out["reference_mean_tasks_per_s"] = round(ref, 1)
        out["drain_vs_reference"] = round(out["drain_tasks_per_s"] / ref, 2)
        out["drain_after_startup_vs_reference"] = round(
            out["drain_tasks_per_s_after_startup"] / ref, 2)
        out["drain_vs_batched_reference"] = round(
            out["drain_tasks_per_s"] / out["reference_batched_tasks_per_s"], 3)
    if "drain_tasks_per_s" in out and "pgqueuer_jobs_per_s" in out:
        out["drain_vs_pgqueuer"] = round(out["drain_tasks_per_s"] / out["pgqueuer_jobs_per_s"], 2)
    out.update(defaults_vs_pgqueuer(out))
    out["durations_s"] = durations
    out["total_s"] = round(time.perf_counter() - started, 1)
    return out


def defaults_vs_pgqueuer(out: dict[str, Any]) -> dict[str, Any]:
    """One worker at the defaults against pgqueuer's best, like for like.

    Both drained the same number of tasks on the same server in this run, start-up
    counted; the CPU per task of both sides' processes and of PostgreSQL stand beside.
    """
    if "drain_defaults_tasks_per_s" not in out or "pgqueuer_jobs_per_s" not in out:
        return {}
    if out.get("drain_defaults_tasks") != out.get("pgqueuer_jobs"):
        raise RuntimeError(f"the defaults drained {out.get('drain_defaults_tasks')} tasks and "
                           f"pgqueuer {out.get('pgqueuer_jobs')} jobs: not comparable")
    ours = (out["drain_defaults_worker_cpu_ms_per_task"],
            out["drain_defaults_postgres_cpu_ms_per_task"])
    theirs = (out["pgqueuer_cpu_ms_per_job"], out["pgqueuer_postgres_cpu_ms_per_job"])
    return {
        "drain_defaults_vs_pgqueuer": round(
            out["drain_defaults_tasks_per_s"] / out["pgqueuer_jobs_per_s"], 2),
        "drain_defaults_vs_pgqueuer_cpu_ms_per_task": {
            "tasks": out["pgqueuer_jobs"],
            "orgchart_worker": ours[0], "orgchart_postgres": ours[1],
            "pgqueuer_worker": theirs[0], "pgqueuer_postgres": theirs[1],
            "orgchart_total": None if None in ours else round(sum(ours), 4),
            "pgqueuer_total": None if None in theirs else round(sum(theirs), 4)},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the command line, run, print the headline and write the JSON file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "latest.json")
    parser.add_argument("--only", default=",".join(ORDER),
                        help=f"comma-separated subset of: {', '.join(ORDER)}")
    parser.add_argument("--quick", action="store_true", help="toy sizes (checks, not figures)")
    args = parser.parse_args(argv)
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    result = run(only, args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"== wrote {args.out} ({result['total_s']} s)")
    for key in ("drain_tasks_per_s", "drain_settings", "reference_tasks_per_s",
                "reference_after_drain_tasks_per_s", "drain_vs_reference",
                "pgqueuer_jobs_per_s", "drain_vs_pgqueuer", "drain_defaults_tasks_per_s",
                "drain_defaults_vs_pgqueuer", "drain_defaults_vs_pgqueuer_cpu_ms_per_task",
                "drain_pair_ratio_median", "drain_pair_async_ratio_median", "pickup_p50_ms",
                "pickup_p95_ms", "fanin_p95_ms",
                "claim_ms_small_table",
                "claim_ms_1m_finished", "tree_ms_10k", "scrape_ms_1m_finished",
                "worker_peak_rss_mb",
                "makespan_vs_critical_path", "peak_calls_in_flight",
                "rss_per_task_in_flight_kb", "sync_vs_async_makespan", "charge_p99_ms",
                "charge_loop_p99_ms",
                "charge_direct_p99_ms", "transport_lean_burst_cpu_ms_per_call",
                "transport_httpx_burst_cpu_ms_per_call"):
        if key in result:
            print(f"  {key}: {result[key]}")
    return result


if __name__ == "__main__":
    main()
