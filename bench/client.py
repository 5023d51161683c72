"""client_submit_wait_ms: what `orgchart.Client.run` adds to a bare `orgchart run`.

The seed's tree (ceo > intel_director > three scouts) on the offline backend, in a
scratch database, run alternately by:

- **bare**: what `orgchart run GOAL` does once its process is up: `build_root` and
  `submit_root`, then `runtime.inprocess.run_tree` (a worker in this process for that
  tree only) and one read of the finished tree (`tree_for`), without drawing it;
- **client**: `orgchart.Client(url).run(GOAL)` on a client opened once: the same
  validation and insert, the no-live-worker check, the same `run_tree`, the root's
  status read with a backoff, and one read of the finished tree.

Each timing runs from the call to the answer in hand (process start-up, opening the
database and building the runtime are left out: both pay them once). Prints the medians,
their difference (`client_submit_wait_ms`) and the 90th percentiles.

    python -m bench.client [--runs N] [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from bench.common import median, ms, percentile, report, scratch_database

GOAL = "Assess the market for durable agent runtimes"


def _bare(runtime: Any) -> float:
    """One `orgchart run` of the tree, minus start-up and drawing; seconds."""
    from runtime.inprocess import run_tree
    from runtime.views import tree_for
    from runtime.wiring import build_root, submit_root

    started = time.perf_counter()
    new = build_root(runtime.registry, runtime.settings, goal=GOAL)
    task, _ = submit_root(runtime.store, new, "bench", 5.0)
    status = run_tree(runtime, task["id"], timeout=120)
    tree = tree_for(runtime.store, task["id"])
    elapsed = time.perf_counter() - started
    assert status == tree["status"] == "done", tree["status"]
    return elapsed


def _client(client: Any) -> float:
    """One `client.run` of the tree; seconds."""
    started = time.perf_counter()
    run = client.run(GOAL, timeout=120)
    elapsed = time.perf_counter() - started
    assert run.status == "done" and run.result, run
    return elapsed


def main() -> None:
    """Run both ways alternately and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="Trees each way.")
    parser.add_argument("--quick", action="store_true", help="3 trees each way.")
    args = parser.parse_args()
    runs = 3 if args.quick else args.runs
    os.environ["ORGCHART_LLM__BACKEND"] = "offline"
    import orgchart
    from runtime.config import load_settings
    from runtime.wiring import build_runtime

    with scratch_database("client") as url:
        env = {**os.environ, "ORGCHART_DATABASE_URL": url}
        runtime = build_runtime(load_settings(env=env))
        client = orgchart.Client(url)
        _bare(runtime), _client(client)  # warm both paths once (imports, plans, pools)
        bare: list[float] = []
        wrapped: list[float] = []
        for _ in range(runs):
            bare.append(_bare(runtime))
            wrapped.append(_client(client))
        client.close()
        runtime.store.dispose()
    report("client", {
        "runs_each": runs,
        "bare_run_ms_median": round(ms(median(bare)), 1),
        "client_run_ms_median": round(ms(median(wrapped)), 1),
        "client_submit_wait_ms": round(ms(median(wrapped) - median(bare)), 1),
        "bare_run_ms_p90": round(ms(percentile(bare, 90)), 1),
        "client_run_ms_p90": round(ms(percentile(wrapped, 90)), 1),
    })


if __name__ == "__main__":
    main()
