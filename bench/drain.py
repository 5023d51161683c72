"""Drain throughput: 20,000 no-op root tasks through the full lifecycle by real workers.

The tasks (agent ``noop`` from ``tests.support_agents``) are bulk-inserted with
``store.tasks.submit_many``; then ``procs`` real ``orgchart worker --agents noop,judge --once``
processes (offline model backend) run them: claim -> run -> ``judging`` -> judge ->
``done``, every transition with its event row. The clock starts when the processes are
spawned (their start-up counts) and stops when the last one has exited (``--once``: a
worker exits when it finds the queue empty), as ``bench.pgqueuer_drain``'s clock does;
then every task must be ``done``. The database's own clock gives a second window, first
claim to last ``done`` event, which leaves process start-up out. The CPU time the worker
processes and the PostgreSQL server (when it runs on this machine) spent, per task, says
which side is the bottleneck.

A short sweep over a few settings (processes x sync threads x batch size) on a smaller
queue picks the best for this machine; the full queue then runs with it, and again with
one worker at the defaults (``1xdefault``) unless that was the best: the defaults' figures
(``drain_defaults_*``) come from the same number of tasks as pgqueuer's best drain.

    python -m bench.drain [--tasks 20000] [--sweep-tasks 10000] [--settings 1xdefault,2x32x100,...]
"""

from __future__ import annotations

import argparse
import signal
import time
from dataclasses import dataclass
from typing import Any

from bench.common import (
    children_cpu_seconds,
    compile_sources,
    connect,
    open_store,
    peak_rss_mb,
    report,
    scratch_database,
    server_cpu_seconds,
    spawn_worker,
    stop_worker,
    submit_noop,
    truncate_tasks,
    worker_command,
)

#: (processes, sync threads, batch size) tried by the sweep; ``1xdefault`` is one worker at
#: the ``[worker]`` defaults (no option given: max_in_flight, sync_threads, batch_size).
DEFAULT_GRID = ("1xdefault", "1x64x200", "2x64x200", "2x128x200", "3x128x200", "4x64x200")
POLL_SECONDS = 0.05
EVENTS_PER_TASK = 3  # submitted, claimed, done (a noop task has no criteria: no judging)


@dataclass(frozen=True)
class Setting:
    """Worker processes, sync threads per process, batch size per claim."""

    procs: int
    sync_threads: int | None  # None: the [worker] defaults
    batch_size: int | None

    @classmethod
    def parse(cls, text: str) -> Setting:
        """``2x32x100`` -> Setting(2, 32, 100); ``1xdefault`` -> Setting(1, None, None)."""
        parts = text.lower().split("x")
        try:
            if len(parts) == 2 and parts[1] == "default":
                procs, conc, batch = int(parts[0]), None, None
            else:
                procs, conc, batch = (int(x) for x in parts)
        except ValueError:
            raise ValueError(f"cannot read setting {text!r}: use PROCSxTHREADSxBATCH "
                             "(for example 2x32x100) or PROCSxdefault") from None
        if min(procs, conc or 1, batch or 1) < 1:
            raise ValueError(f"setting {text!r}: every number must be at least 1")
        return cls(procs, conc, batch)

    @property
    def defaults(self) -> bool:
        """Whether the workers run at the ``[worker]`` defaults."""
        return self.sync_threads is None and self.batch_size is None

    def __str__(self) -> str:
        if self.defaults:
            return f"{self.procs}xdefault"
        return f"{self.procs}x{self.sync_threads}x{self.batch_size}"


def load_queue(url: str, n: int, agent: str = "noop") -> None:
    """Empty the tables and bulk-insert ``n`` pending tasks for ``agent`` (no-op agents)."""
    truncate_tasks(url)
    store = open_store(url, pool_size=1)
    try:
        submit_noop(store, n, agent=agent)
    finally:
        store.dispose()
    with connect(url) as conn:
        conn.execute("VACUUM ANALYZE tasks")
        conn.execute("VACUUM ANALYZE task_events")


def trial(url: str, n: int, setting: Setting, timeout: float = 600.0,
          agent: str = "noop") -> dict[str, Any]:
    """Drain ``n`` tasks with ``setting``; return rate, seconds and the workers' peak RSS.

    ``agent`` is ``noop`` (a plain ``def run``: the worker runs it on its agent threads) or
    ``async_noop`` (``async def run``: awaited on the worker's loop, like pgqueuer's job).
    """
    load_queue(url, n, agent)
    compile_sources()
    cmd = worker_command(f"{agent},judge", batch_size=setting.batch_size,
                         sync_threads=setting.sync_threads, once=True)
    server_cpu0, workers_cpu0 = server_cpu_seconds(url), children_cpu_seconds()
    started = time.perf_counter()
    procs = [spawn_worker(url, cmd) for _ in range(setting.procs)]
    peaks = [0.0] * len(procs)
    try:
        # --once: each worker exits by itself once it finds the queue empty. The clock
        # stops when the last one has exited, as bench.pgqueuer_drain's does; nothing
        # queries the database meanwhile (a count every 50 ms cost this server 2.7 ms a
        # time, load pgqueuer's trial never carried).
        while any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                peaks[i] = max(peaks[i], peak_rss_mb(p.pid) or 0.0)
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"the workers still ran after {timeout:.0f} s")
            time.sleep(POLL_SECONDS)
        elapsed = time.perf_counter() - started
        with connect(url) as conn:
            done = int(conn.execute("SELECT count(*) FROM tasks WHERE status = 'done'")
                       .fetchone()[0])  # type: ignore[index]
        if done < n:
            raise RuntimeError(f"the workers exited with {done} of {n} tasks done")
    finally:
        errors = [stop_worker(p, timeout=60.0) for p in procs]
    server_cpu1, workers_cpu1 = server_cpu_seconds(url), children_cpu_seconds()
    codes = [p.returncode for p in procs]
    if any(code not in (0, -signal.SIGTERM) for code in codes):
        worst = errors[codes.index(max(codes))]
        raise RuntimeError(f"a worker failed (exit codes {codes}): {worst}")
    with connect(url) as conn:
        window, events = conn.execute(
            "SELECT extract(epoch FROM max(at) FILTER (WHERE to_status = 'done') "
            "                        - min(at) FILTER (WHERE to_status = 'running')), "
            "       count(*) FROM task_events").fetchone()  # type: ignore[misc]
    return {
        "setting": str(setting),
        "tasks": n,
        "seconds": round(elapsed, 3),
        "tasks_per_s": round(n / elapsed, 1),
        "db_window_seconds": round(float(window), 3),
        "tasks_per_s_after_startup": round(n / float(window), 1),
        "events_per_task": round(events / n, 2),
        "peak_rss_mb": round(max(peaks), 1),
        "worker_cpu_ms_per_task": round((workers_cpu1 - workers_cpu0) / n * 1000, 4),
        "postgres_cpu_ms_per_task": (None if server_cpu0 is None or server_cpu1 is None
                                     else round((server_cpu1 - server_cpu0) / n * 1000, 4)),
    }


def measure(url: str, n: int = 20_000, sweep_n: int = 10_000,
            grid: tuple[str, ...] = DEFAULT_GRID) -> dict[str, Any]:
    """Sweep ``grid`` on ``sweep_n`` tasks, then drain ``n`` with the best.

    One worker at the defaults (``1xdefault``, when in the grid) also drains the full
    ``n`` tasks: the figure set beside pgqueuer's best, which drains ``n`` jobs too.
    """
    settings = [Setting.parse(s) for s in grid]
    sweep: list[dict[str, Any]] = []
    if len(settings) > 1:
        for s in settings:
            sweep.append(trial(url, sweep_n, s))
            print(f"  sweep {s}: {sweep[-1]['tasks_per_s']} tasks/s "
                  f"({sweep[-1]['tasks_per_s_after_startup']} after start-up)", flush=True)
        best = settings[max(range(len(sweep)), key=lambda i: sweep[i]["tasks_per_s"])]
    else:
        best = settings[0]
    final = trial(url, n, best)
    if final["events_per_task"] < EVENTS_PER_TASK:
        raise RuntimeError(f"only {final['events_per_task']} events per task were written")
    defaults = Setting(1, None, None)
    at_defaults: dict[str, Any] | None = None
    if best == defaults:
        at_defaults = final
    elif defaults in settings:
        at_defaults = trial(url, n, defaults)
        print(f"  {defaults} on {n}: {at_defaults['tasks_per_s']} tasks/s", flush=True)
    return {
        "drain_tasks_per_s": final["tasks_per_s"],
        "drain_seconds": final["seconds"],
        "drain_tasks_per_s_after_startup": final["tasks_per_s_after_startup"],
        "drain_tasks": n,
        "drain_settings": {"processes": best.procs, "sync_threads": best.sync_threads,
                           "batch_size": best.batch_size},
        "drain_events_per_task": final["events_per_task"],
        "drain_worker_peak_rss_mb": final["peak_rss_mb"],
        "drain_worker_cpu_ms_per_task": final["worker_cpu_ms_per_task"],
        "drain_postgres_cpu_ms_per_task": final["postgres_cpu_ms_per_task"],
        "drain_sweep": sweep,
        **_at_defaults(at_defaults),
    }


def _at_defaults(trial_: dict[str, Any] | None) -> dict[str, Any]:
    """One worker at the defaults on the full queue, as figures of their own."""
    if trial_ is None:
        return {}
    if trial_["events_per_task"] < EVENTS_PER_TASK:
        raise RuntimeError(f"only {trial_['events_per_task']} events per task were written")
    return {"drain_defaults_tasks_per_s": trial_["tasks_per_s"],
            "drain_defaults_tasks": trial_["tasks"],
            "drain_defaults_tasks_per_s_after_startup": trial_["tasks_per_s_after_startup"],
            "drain_defaults_events_per_task": trial_["events_per_task"],
            "drain_defaults_worker_cpu_ms_per_task": trial_["worker_cpu_ms_per_task"],
            "drain_defaults_postgres_cpu_ms_per_task": trial_["postgres_cpu_ms_per_task"]}


def main(n: int = 20_000, sweep_n: int = 10_000, grid: tuple[str, ...] = DEFAULT_GRID,
         server: str | None = None) -> dict[str, Any]:
    """Run in a scratch database; print and return the figures."""
    with scratch_database("drain", server) as url:
        figures = measure(url, n, sweep_n, grid)
    return report(f"drain ({n} noop tasks, full lifecycle, orgchart worker processes)", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--sweep-tasks", type=int, default=10_000)
    parser.add_argument("--settings", default=",".join(DEFAULT_GRID),
                        help="PROCSxTHREADSxBATCH or PROCSxdefault, comma-separated; "
                             "one means no sweep")
    a = parser.parse_args()
    main(a.tasks, a.sweep_tasks, tuple(s for s in a.settings.split(",") if s.strip()))
