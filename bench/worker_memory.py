"""A worker's memory while draining: peak RSS, and how much it grew along the way.

One ``orgchart worker --agents noop,judge --once`` process drains ``n`` no-op tasks.
Its ``/proc/<pid>/status`` is read every 50 ms: ``VmHWM`` (the peak resident set) is
the figure; ``VmRSS`` when a tenth of the queue is done and again at the end shows
whether memory keeps growing with the number of tasks handled (a leak) or levels off.

    python -m bench.worker_memory [--tasks 20000] [--sync-threads 64] [--batch-size 200]
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import (
    connect,
    open_store,
    report,
    scratch_database,
    spawn_worker,
    stop_worker,
    submit_noop,
    worker_command,
)

POLL_SECONDS = 0.05


def _status_mb(pid: int, field: str) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def measure(url: str, n: int = 20_000, sync_threads: int | None = 64,
            batch_size: int | None = 200, timeout: float = 600.0) -> dict[str, Any]:
    """Drain ``n`` tasks with one worker and sample its memory."""
    store = open_store(url, pool_size=1)
    try:
        submit_noop(store, n)
    finally:
        store.dispose()
    proc = spawn_worker(url, worker_command("noop,judge", batch_size=batch_size,
                                            sync_threads=sync_threads, once=True))
    peak = 0.0
    rss_tenth: float | None = None
    rss_end = 0.0
    started = time.perf_counter()
    try:
        with connect(url) as conn:
            while True:
                done = int(conn.execute("SELECT count(*) FROM tasks WHERE status = 'done'")
                           .fetchone()[0])  # type: ignore[index]
                hwm = _status_mb(proc.pid, "VmHWM")
                rss = _status_mb(proc.pid, "VmRSS")
                if hwm is not None and rss is not None:
                    peak, rss_end = max(peak, hwm), rss
                    if rss_tenth is None and done >= n // 10:
                        rss_tenth = rss
                if done >= n:
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"the worker exited with {done} of {n} tasks done")
                if time.perf_counter() - started > timeout:
                    raise TimeoutError(f"{done} of {n} tasks done after {timeout:.0f} s")
                time.sleep(POLL_SECONDS)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30.0)
    finally:
        stderr = stop_worker(proc)
    if proc.returncode not in (0, -signal.SIGTERM):
        raise RuntimeError(f"the worker exited with {proc.returncode}: {stderr}")
    return {
        "worker_peak_rss_mb": round(peak, 1),
        "worker_rss_at_10pct_mb": round(rss_tenth or 0.0, 1),
        "worker_rss_at_end_mb": round(rss_end, 1),
        "worker_memory_tasks": n,
        "worker_memory_settings": {"sync_threads": sync_threads, "batch_size": batch_size},
    }


def main(n: int = 20_000, sync_threads: int | None = 64, batch_size: int | None = 200,
         server: str | None = None) -> dict[str, Any]:
    """Run in a scratch database; print and return the figures."""
    with scratch_database("memory", server) as url:
        figures = measure(url, n, sync_threads, batch_size)
    return report(f"worker memory (one worker draining {n} noop tasks)", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--sync-threads", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=200)
    a = parser.parse_args()
    main(a.tasks, a.sync_threads, a.batch_size)
