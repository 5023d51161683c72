"""Pickup latency: from a submit's commit to the agent starting, on an idle worker.

One ``orgchart worker --agents stamp --agents-module bench.agents`` process waits on
LISTEN/NOTIFY. Tasks are submitted one at a time (``store.tasks.submit``) with the worker idle
in between; the ``stamp`` agent returns ``time.time()`` at the start of its ``run``, and
the figure is that minus the time ``submit`` returned (its commit done), on one
machine's clock. It includes the notification, the claim, input validation and the
input policies: everything before the agent's own code.

    python -m bench.pickup [--samples 50]
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

from bench.common import (
    median,
    ms,
    open_store,
    percentile,
    report,
    scratch_database,
    spawn_worker,
    stop_worker,
    worker_command,
)
from runtime.store.rows import NewTask
from runtime.store.store import Store

IDLE_SECONDS = 0.1  # the worker is back in its wait before each submit
POLL_SECONDS = 0.002
TIMEOUT_SECONDS = 30.0


def submit_and_wait(store: Store, label: str, timeout: float = TIMEOUT_SECONDS) -> float:
    """Submit one ``stamp`` task; return seconds from submit's commit to the agent's start."""
    task, _ = store.tasks.submit(NewTask("stamp", "work", {"goal": label},
                                         idempotency_key=f"pickup-{uuid.uuid4().hex}"))
    committed = time.time()
    deadline = time.perf_counter() + timeout
    while True:
        row = store.reads.get(task["id"])
        if row["result"] is not None:
            return float(row["result"]["started"]) - committed
        if row["status"] in ("failed", "escalated"):
            raise RuntimeError(f"the stamp task ended {row['status']}: {row['error']}")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"no worker picked up the task within {timeout:.0f} s")
        time.sleep(POLL_SECONDS)


def measure(url: str, samples: int = 50) -> dict[str, Any]:
    """Start one idle worker, submit ``samples`` tasks one by one, time each pickup."""
    store = open_store(url, pool_size=2)
    proc = spawn_worker(url, worker_command("stamp", agents_module="bench.agents"))
    try:
        try:
            submit_and_wait(store, "warm-up", timeout=120.0)  # the worker is up and listening
        except TimeoutError:
            raise RuntimeError(f"the worker never started: {stop_worker(proc)}") from None
        times = []
        for i in range(samples):
            time.sleep(IDLE_SECONDS)
            times.append(submit_and_wait(store, f"sample {i}"))
    finally:
        stderr = stop_worker(proc)
        store.dispose()
    if proc.returncode not in (0, -15):
        raise RuntimeError(f"the worker exited with {proc.returncode}: {stderr}")
    return {
        "pickup_p50_ms": ms(median(times)),
        "pickup_p95_ms": ms(percentile(times, 95)),
        "pickup_max_ms": ms(max(times)),
        "pickup_samples": samples,
    }


def main(samples: int = 50, server: str | None = None) -> dict[str, Any]:
    """Run in a scratch database; print and return the figures."""
    with scratch_database("pickup", server) as url:
        figures = measure(url, samples)
    return report("pickup (submit commit -> agent start, one idle listening worker)", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50)
    a = parser.parse_args()
    main(a.samples)
