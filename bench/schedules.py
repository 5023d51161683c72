"""schedule_slots: one schedule every second, ticked by worker processes and a ``serve``,
one process SIGKILLed (and replaced) every ``kill_every`` seconds.

Three ``orgchart worker`` processes and one ``orgchart serve`` tick the schedules (each
in its own thread, twice a second, jittered). Once all are up, a schedule firing a
``noop`` root every second is resumed; every ``kill_every`` seconds one process, in
turn, is SIGKILLed (perhaps inside a tick's transaction) and a new one started in its
place. After ``seconds`` the schedule is paused and the slots are counted from the rows:

- every slot from the first to the last one handled before the pause is recorded exactly
  once: fired (with its own root) or counted in a ``missed`` row (outside the catch-up
  window); none twice, none unaccounted;
- slot-to-root latency: the root's insert time (its transaction's start) minus the slot,
  p50, p95 and max.

    python -m bench.schedules [--seconds 60] [--kill-every 10] [--workers 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import signal
import subprocess
import sys
import threading
import time
from decimal import Decimal
from typing import Any

from bench.common import (
    REPO_ROOT,
    compile_sources,
    ms,
    open_store,
    percentile,
    report,
    scratch_database,
    wait_serving,
    worker_env,
)
from runtime.schedules.commands import add_schedule, resume_schedule
from runtime.store.rows import NewTask
from runtime.store.store import Store

NAME = "bench-every-second"
START_TIMEOUT_SECONDS = 120.0
MODULE = "tests.support_agents"


def _command(kind: str) -> list[str]:
    main = [sys.executable, "-c", "from runtime.cli.app import main; main()"]
    if kind == "serve":
        return [*main, "serve", "--port", "0", "--agents-module", MODULE,
                "--log-level", "warning"]
    return [*main, "worker", "--agents", "noop", "--agents-module", MODULE]


def _spawn(url: str, kind: str, wait: bool) -> subprocess.Popen[str]:
    """Start a worker or serve; with ``wait``, return once it says it is serving."""
    proc = subprocess.Popen(_command(kind), env=worker_env(url), cwd=str(REPO_ROOT),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    if wait:
        wait_serving(proc, lines, START_TIMEOUT_SECONDS)
    else:  # drain its stderr so that it never blocks on a full pipe
        wait_serving_later(proc, lines)
    return proc


def wait_serving_later(proc: subprocess.Popen[str], lines: list[str]) -> None:
    """Read ``proc``'s stderr in a thread (a replacement is not waited for)."""
    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()


def _count(store: Store, first: dt.datetime, last: dt.datetime) -> dict[str, Any]:
    """The slots' figures from the recorded rows (see the module docstring)."""
    runs = store.schedules.runs(NAME, 1_000_000)
    fired = [r for r in runs if r["state"] == "fired"]
    missed = sum(int(r["slots"]) for r in runs if r["state"] == "missed")
    expected = int((last - first).total_seconds()) + 1
    seen: dict[dt.datetime, int] = {}
    for r in runs:
        if r["state"] == "missed":
            for i in range(int(r["slots"])):
                slot = r["slot_at"] + dt.timedelta(seconds=i)
                seen[slot] = seen.get(slot, 0) + 1
        else:
            seen[r["slot_at"]] = seen.get(r["slot_at"], 0) + 1
    want = [first + dt.timedelta(seconds=i) for i in range(expected)]
    roots = {r["root_id"] for r in fired}
    latencies = [(r["root_created_at"] - r["slot_at"]).total_seconds() for r in fired
                 if r["root_created_at"] is not None]
    return {
        "schedule_slots_expected": expected,
        "schedule_slots_fired": len(fired),
        "schedule_slots_missed_recorded": missed,
        "schedule_slots_skipped": sum(1 for r in runs if r["state"] == "skipped"),
        "schedule_slots_twice": sum(1 for n in seen.values() if n > 1),
        "schedule_slots_unaccounted": sum(1 for s in want if s not in seen),
        "schedule_roots_per_fired_slot": round(len(roots) / max(1, len(fired)), 3),
        "schedule_latency_p50_ms": ms(percentile(latencies, 50)) if latencies else None,
        "schedule_latency_p95_ms": ms(percentile(latencies, 95)) if latencies else None,
        "schedule_latency_max_ms": ms(max(latencies)) if latencies else None,
    }


def measure(url: str, seconds: float, kill_every: float, workers: int,
            serve: bool) -> dict[str, Any]:
    """Start the processes, run the schedule, kill in turn, count the slots."""
    store = open_store(url, pool_size=2)
    add_schedule(store, name=NAME, cron=None, every="1s", timezone=None, overlap="allow",
                 task=NewTask("noop", "work", {"goal": "tick"}, budget_usd=Decimal("1")),
                 actor="bench")
    store.schedules.set_paused(NAME, True)
    kinds = ["worker"] * workers + (["serve"] if serve else [])
    procs = [_spawn(url, kind, wait=True) for kind in kinds]
    kills = 0
    try:
        first = _next_slot(resume_schedule(store, NAME))
        end = time.monotonic() + seconds
        next_kill = time.monotonic() + kill_every
        while time.monotonic() < end:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
            if time.monotonic() >= next_kill:
                victim = kills % len(procs)
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait(30)
                procs[victim] = _spawn(url, kinds[victim], wait=False)
                kills += 1
                next_kill += kill_every
        # The pause waits for a tick holding the row; slots before its next_at are handled.
        row = store.schedules.set_paused(NAME, True)
        now = store.schedules.get(NAME)["db_now"]
        last = row["next_at"] - dt.timedelta(seconds=1)
        due_at_pause = max(0, int((now - row["next_at"]).total_seconds()) + 1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    figures = _count(store, first, last)
    store.dispose()
    return {**figures, "schedule_slots_due_at_pause": due_at_pause,
            "schedule_kills": kills, "schedule_processes": len(kinds),
            "schedule_seconds": seconds}


def _next_slot(row: dict[str, Any]) -> dt.datetime:
    return dt.datetime.fromisoformat(row["next_at"])


def main(seconds: float = 60.0, kill_every: float = 10.0, workers: int = 3,
         serve: bool = True, server: str | None = None) -> dict[str, Any]:
    """Run in a scratch database; print and return the figures."""
    compile_sources()
    with scratch_database("schedules", server) as url:
        figures = measure(url, seconds, kill_every, workers, serve)
    return report(f"schedule_slots ({workers} workers{' + serve' if serve else ''}, one "
                  f"schedule every second for {seconds:g} s, a process SIGKILLed every "
                  f"{kill_every:g} s)", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--no-serve", action="store_true")
    a = parser.parse_args()
    main(a.seconds, a.kill_every, a.workers, not a.no_serve)
