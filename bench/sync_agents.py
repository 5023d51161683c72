"""Sync agents against async ones: the 931-task makespan tree written both ways.

    python -m bench.sync_agents [--leads 30] [--writers 30] [--delay 1.0] [--rounds 1]

The tree of ``bench.makespan`` (a planner -> ``leads`` leads -> ``writers`` writers, each
writer one model call of ``delay`` seconds, the planner one more) run by one
``orgchart worker`` at the default settings (``[ollama] max_parallel`` raised to 2,000,
as in ``bench.makespan``): once with the ``async def`` agents (``mk_*``), once with the
same agents as plain ``def`` ones (``mks_*``: ``ctx.llm.complete`` blocks its thread),
alternating for ``rounds`` rounds; the best of each is kept.

Figures: ``sync_makespan_seconds``, ``async_makespan_seconds``,
``sync_vs_async_makespan`` (goal <= 1.5), the peak calls in flight at the model server
for each (``sync_peak_calls_in_flight``: goal 900), the worker's peak thread count and
RSS, and ``sync_rss_per_parked_thread_kb``: (peak RSS - idle RSS) / peak calls in flight
of the sync run, beside the async run's per-call figure.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import report
from bench.makespan import measure


def _keep(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return min(runs, key=lambda r: float(r["makespan_seconds"]))


def main(leads: int = 30, writers: int = 30, delay: float = 1.0, rounds: int = 1,
         server: str | None = None) -> dict[str, Any]:
    """Run the tree sync and async, alternating; print and return the figures."""
    sync_runs: list[dict[str, Any]] = []
    async_runs: list[dict[str, Any]] = []
    for _ in range(rounds):
        async_runs.append(measure(leads, writers, delay, server, prefix="mk"))
        sync_runs.append(measure(leads, writers, delay, server, prefix="mks"))
    sync, async_ = _keep(sync_runs), _keep(async_runs)
    figures: dict[str, Any] = {"sync_tree_tasks": sync["makespan_tasks"],
                               "sync_model_delay_seconds": delay}
    for label, run in (("sync", sync), ("async", async_)):
        figures.update({
            f"{label}_makespan_seconds": run["makespan_seconds"],
            f"{label}_vs_critical_path": run["makespan_vs_critical_path"],
            f"{label}_peak_calls_in_flight": run["peak_calls_in_flight"],
            f"{label}_peak_threads": run["makespan_peak_threads"],
            f"{label}_idle_rss_mb": run["makespan_idle_rss_mb"],
            f"{label}_peak_rss_mb": run["makespan_peak_rss_mb"],
            f"{label}_rss_per_call_kb": run["rss_per_task_in_flight_kb"],
            f"{label}_worker_cpu_ms_per_task": run["makespan_worker_cpu_ms_per_task"],
        })
    figures["sync_vs_async_makespan"] = round(
        sync["makespan_seconds"] / async_["makespan_seconds"], 3)
    parked = max(1, sync["makespan_peak_threads"] - sync["makespan_idle_threads"])
    figures["sync_extra_threads_at_peak"] = parked
    figures["sync_rss_per_parked_thread_kb"] = round(
        (sync["makespan_peak_rss_mb"] - async_["makespan_peak_rss_mb"]) * 1024 / parked, 1)
    figures["sync_all_makespans_seconds"] = [r["makespan_seconds"] for r in sync_runs]
    figures["async_all_makespans_seconds"] = [r["makespan_seconds"] for r in async_runs]
    return report("sync_agents", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--leads", type=int, default=30)
    parser.add_argument("--writers", type=int, default=30)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=1)
    a = parser.parse_args()
    main(a.leads, a.writers, a.delay, a.rounds)
