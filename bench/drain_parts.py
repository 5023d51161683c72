"""Where a drained task's CPU goes: claim, execute, finish, each in one thread, no loop.

``bench.drain`` gives the worker's CPU per task as a whole. This one takes the three
steps of the worker's path apart and runs them one after another in this process, on
batches of ``batch`` noop tasks: ``store.claims.claim`` (the claim statement and its 51 columns
typed into ``TaskRow``), ``Executor.execute`` with the judge inline as a worker that
serves the judge runs it (input schema and policies, the agent, output policies, the
judge), and ``store.transitions.finish_running`` (the batch as one JSON document, the fan-in). The
process CPU time of each step, per task, is what the worker's Python pays for it before
any thread hand-off, event-loop or notification cost; the rest of the worker's CPU per
task (``drain_worker_cpu_ms_per_task``) is those.

    python -m bench.drain_parts [--n 20000] [--batch 100]
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from bench.common import report, scratch_database, worker_env
from bench.drain import load_queue


def measure(url: str, n: int, batch: int) -> dict[str, Any]:
    """Drain ``n`` queued noop tasks in this thread; CPU microseconds per task per step."""
    from runtime.config import load_settings
    from runtime.wiring import build_runtime

    # The worker's settings: this database, the offline model, no configuration file.
    runtime = build_runtime(load_settings(env=worker_env(url)), ["tests.support_agents"])
    executor, store = runtime.executor(), runtime.store
    executor.inline_judge = True  # as in a worker serving 'judge' (the drain's workers do)
    lease_lost = threading.Event()
    spent = {"claim": 0.0, "execute": 0.0, "finish": 0.0}
    done, statuses = 0, set[str]()
    cpu = time.process_time
    try:
        while True:
            t0 = cpu()
            rows = store.claims.claim(["noop"], batch, "drain-parts", 60.0)
            t1 = cpu()
            if not rows:
                break
            actions = [executor.execute(row, lease_lost) for row in rows]
            t2 = cpu()
            store.transitions.finish_running(actions, "drain-parts")
            t3 = cpu()
            spent["claim"] += t1 - t0
            spent["execute"] += t2 - t1
            spent["finish"] += t3 - t2
            statuses.update(a.to_status for a in actions)
            done += len(rows)
    finally:
        store.dispose()
    if done != n or statuses != {"done"}:
        raise RuntimeError(f"drained {done} of {n} tasks, outcomes {sorted(statuses)}")
    per_task = {k: round(v / done * 1e6, 1) for k, v in spent.items()}
    return {
        "drain_parts_tasks": done,
        "drain_parts_batch": batch,
        "drain_parts_cpu_us_per_task": {**per_task, "total": round(sum(per_task.values()), 1)},
    }


def main(n: int = 20_000, batch: int = 100, server: str | None = None) -> dict[str, Any]:
    """Queue ``n`` noop tasks in a scratch database and take their drain apart."""
    with scratch_database("drain_parts", server) as url:
        load_queue(url, n)
        figures = measure(url, n, batch)
    return report(f"drain_parts ({n} noop tasks, claim / execute / finish in one thread)",
                  figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=100)
    a = parser.parse_args()
    main(a.n, a.batch)
