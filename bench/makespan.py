"""Makespan: a 931-task tree against models that take 1 s, on one worker process.

    python -m bench.makespan [--leads 30] [--writers 30] [--delay 1.0] [--wide-leads 40]

A planner delegates to ``leads`` leads, each delegating to ``writers`` writers; every
writer makes one model call, the planner one more when it aggregates, so the critical
path is two calls: 2 x ``delay`` seconds. The model server is ``bench.model_server`` on
loopback (its own process; it counts calls in flight). One ``orgchart worker`` runs at
the default settings, except ``[ollama] max_parallel`` and ``cloud_max_parallel`` raised
to 2,000 (a deep queue routes calls to the cloud model).

Figures: ``makespan_seconds`` (submit to the root's completion),
``makespan_vs_critical_path`` (that / 2 x delay; goal <= 1.25) and ``model_calls``; then
on a wider tree (``--wide-leads``, default leads + 10: 1,200 writers),
``peak_calls_in_flight`` (at the server; goal >= 1,000) and ``rss_per_task_in_flight_kb``
((peak RSS - idle RSS) / peak calls in flight; goal <= 100 KB).
Then once more with agents that sleep ``delay`` instead of calling the model
(``engine_*`` figures): the engine's own share, without the model layer; there every
task of the tree is in flight at once, so RSS per task is (peak - idle) / tasks.
Last, the floor (``bench.model_floor``): the tree's model calls made with no engine at
all, through the official client (``makespan_floor_official_*``) and through bare asyncio
sockets (``makespan_floor_bare_*``); ``makespan_above_floor_seconds`` is what the engine
adds to the first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.common import (
    REPO_ROOT,
    open_store,
    report,
    scratch_database,
    tree_cpu_seconds,
    wait_serving,
    worker_env,
)
from runtime.store.rows import NewTask
from runtime.store.store import Store

TERMINAL = ("done", "failed", "escalated")
WORKER_BOOT = ("import resource; s, h = resource.getrlimit(resource.RLIMIT_NOFILE); "
               "resource.setrlimit(resource.RLIMIT_NOFILE, (h, h)); "
               "from runtime.cli.app import main; main()")


def _vm_kb(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        body: dict[str, Any] = json.loads(resp.read())
    return body


TIMELINE = """
SELECT t.to_agent, e.to_status, e.detail LIKE 'claimed for aggregate%' AS agg,
       round(extract(epoch FROM min(e.at) - (SELECT min(at) FROM task_events))::numeric, 3),
       round(extract(epoch FROM max(e.at) - (SELECT min(at) FROM task_events))::numeric, 3)
FROM task_events e JOIN tasks t ON t.id = e.task_id
GROUP BY 1, 2, 3 ORDER BY 4
"""


CALLS = """
WITH t0 AS (SELECT min(at) AS at FROM task_events)
SELECT count(*),
       round(extract(epoch FROM min(c.created_at) - max(t0.at))::numeric, 3),
       round(extract(epoch FROM max(c.created_at) - max(t0.at))::numeric, 3),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY c.duration_seconds)::numeric, 3),
       round(max(c.duration_seconds)::numeric, 3)
FROM model_calls c, t0
"""


def _timeline(conn: sa.Connection) -> list[str]:
    """When each kind of transition first and last happened, from the submit (seconds),
    and when the model calls were recorded, with their durations as the client saw them."""
    lines = [f"{agent} -> {status}{' (aggregate)' if agg else ''}: {first}..{last}"
             for agent, status, agg, first, last in conn.execute(sa.text(TIMELINE))]
    n, first, last, p50, top = conn.execute(sa.text(CALLS)).one()
    lines.append(f"model calls recorded: {n}, {first}..{last}; duration p50 {p50} s, max {top} s")
    return lines


def start_model_server(delay: float, pieces: int = 0) -> tuple[subprocess.Popen[str], str]:
    """Start ``bench.model_server``; return the process and its base URL.

    ``pieces``: a streamed chat's NDJSON pieces over the delay (0: one line).
    """
    proc = subprocess.Popen([sys.executable, "-m", "bench.model_server", "--delay", str(delay),
                             "--pieces", str(pieces)],
                            cwd=str(REPO_ROOT), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("port "):
        proc.kill()
        raise RuntimeError(f"model server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{line.split()[1]}"


def start_worker(url: str, model_url: str, prefix: str = "mk",
                 extra_env: dict[str, str] | None = None
                 ) -> tuple[subprocess.Popen[str], list[str]]:
    """Start one ``orgchart worker`` on the makespan agents; wait until it serves.

    ``prefix``: ``mk`` for the ``async def`` agents, ``mks`` for the plain ``def`` ones.
    ``extra_env``: more settings (``ORGCHART_STREAMING__ENABLED``, ...).
    """
    env = worker_env(url)
    env.update(extra_env or {})
    env.update({"ORGCHART_LLM__BACKEND": "ollama", "ORGCHART_OLLAMA__URL": model_url})
    # Both routes: a deep queue routes calls to the cloud model (routing.pending_threshold).
    env["ORGCHART_OLLAMA__MAX_PARALLEL"] = "2000"
    env["ORGCHART_OLLAMA__CLOUD_MAX_PARALLEL"] = "2000"
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER_BOOT, "worker", "--agents",
         f"{prefix}_planner,{prefix}_lead,{prefix}_writer,judge",
         "--agents-module", "bench.agents"],
        env=env, cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    lines: list[str] = []
    wait_serving(proc, lines, 60)
    time.sleep(1.0)  # its LISTEN connection and first poll
    return proc, lines


def measure(leads: int = 30, writers: int = 30, delay: float = 1.0,
            server: str | None = None, simulate: bool = False,
            prefix: str = "mk", pieces: int = 0,
            extra_env: dict[str, str] | None = None,
            during: Callable[[str, Store, Any], Callable[[], None]] | None = None
            ) -> dict[str, Any]:
    """Run the tree once; return the figures (``simulate``: agents sleep, no model).

    ``prefix``: the agents (``mk``: async, ``mks``: sync; see :func:`start_worker`).
    ``pieces`` and ``extra_env``: the model server's and the worker's
    (:func:`start_model_server`, :func:`start_worker`; ``bench.streaming``).
    ``during(url, store, root_id)``: called once the root is submitted; what it returns is
    called once the root has ended, before the database is dropped (``bench.streaming``'s
    reader of the tree's stream).
    """
    expected = 1 + leads + leads * writers
    with scratch_database("makespan", server) as url:
        model_proc, model_url = start_model_server(delay, pieces)
        worker, log_lines = start_worker(url, model_url, prefix, extra_env)
        store = open_store(url)
        try:
            idle_kb = _vm_kb(worker.pid, "VmRSS") or 0
            cpu_before = tree_cpu_seconds(worker.pid)  # with its recorder process
            _get(model_url + "/stats/reset")
            root, _ = store.tasks.submit(NewTask(
                to_agent=f"{prefix}_planner", type="task",
                payload={"goal": "makespan", "leads": leads, "writers": writers,
                         "simulate": delay if simulate else None},
                budget_tokens=10_000_000, budget_usd=Decimal(1000)))
            started = time.monotonic()
            finish = during(url, store, root["id"]) if during is not None else None
            peak_kb = idle_kb
            idle_threads = peak_threads = _vm_kb(worker.pid, "Threads") or 0
            status = "pending"
            while time.monotonic() - started < 600:
                status = store.reads.get(root["id"])["status"]
                peak_kb = max(peak_kb, _vm_kb(worker.pid, "VmRSS") or 0)
                peak_threads = max(peak_threads, _vm_kb(worker.pid, "Threads") or 0)
                if status in TERMINAL:
                    break
                time.sleep(0.02)
            makespan = time.monotonic() - started
            worker_cpu = tree_cpu_seconds(worker.pid) - cpu_before
            counts = _get(model_url + "/stats")
            if finish is not None:
                finish()
            with store.engine.connect() as conn:
                statuses: dict[str, int] = dict(conn.execute(sa.text(
                    "SELECT status, count(*) FROM tasks GROUP BY status")).all())
                calls = conn.execute(sa.text("SELECT count(*) FROM model_calls")).scalar()
                timeline = _timeline(conn)
        finally:
            worker.terminate()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            model_proc.kill()
            model_proc.wait()
            store.dispose()
    if status != "done" or sum(statuses.values()) != expected:
        raise RuntimeError(f"the tree did not finish: root {status}, tasks {statuses}\n"
                           + "".join(log_lines[-30:]))
    peak = int(counts["peak"])
    critical = 2 * delay
    if simulate:
        return {"engine_makespan_seconds": round(makespan, 3),
                "engine_makespan_vs_critical_path": round(makespan / critical, 3),
                "engine_peak_rss_mb": round(peak_kb / 1024, 1),
                "engine_rss_per_task_in_flight_kb": round((peak_kb - idle_kb) / (expected - 1), 1),
                "engine_worker_cpu_ms_per_task": round(worker_cpu / expected * 1000, 3),
                "engine_timeline_seconds": timeline}
    return {
        "makespan_tasks": expected,
        "makespan_model_delay_seconds": delay,
        "makespan_seconds": round(makespan, 3),
        "makespan_critical_path_seconds": critical,
        "makespan_vs_critical_path": round(makespan / critical, 3),
        "peak_calls_in_flight": peak,
        "makespan_model_calls": int(calls or 0),
        # the worker's CPU (all threads, and its recorder process's) from submit to the
        # root's end, per task
        "makespan_worker_cpu_ms_per_task": round(worker_cpu / expected * 1000, 3),
        "makespan_idle_rss_mb": round(idle_kb / 1024, 1),
        "makespan_peak_rss_mb": round(peak_kb / 1024, 1),
        "rss_per_task_in_flight_kb": round((peak_kb - idle_kb) / peak, 1) if peak else None,
        "makespan_idle_threads": idle_threads,
        "makespan_peak_threads": peak_threads,
        "makespan_timeline_seconds": timeline,
    }


def model_floor(calls: int, delay: float, client: str) -> dict[str, Any]:
    """The tree's model calls without the engine (``bench.model_floor``, its own process)."""
    model_proc, model_url = start_model_server(delay)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "bench.model_floor", "--url", model_url, "--calls",
             str(calls), "--client", client],
            cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=300, check=True)
    finally:
        model_proc.kill()
        model_proc.wait()
    figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


def main(leads: int = 30, writers: int = 30, delay: float = 1.0,
         server: str | None = None, wide_leads: int | None = None) -> dict[str, Any]:
    """Measure with the model server, then with agents that only sleep; print both.

    The in-flight figures (``peak_calls_in_flight``, ``rss_per_task_in_flight_kb``) come
    from one more run on a wider tree, ``wide_leads`` leads (default: leads + 10, so
    1,200 writers at the default sizes: the 931-task tree has only 900 calls to make at
    once); the 931-task tree's own peak is ``makespan_peak_calls_in_flight``.
    """
    figures = measure(leads, writers, delay, server)
    figures["makespan_peak_calls_in_flight"] = figures.pop("peak_calls_in_flight")
    figures["makespan_rss_per_call_kb"] = figures.pop("rss_per_task_in_flight_kb")
    wide = measure(wide_leads or leads + 10, writers, delay, server)
    figures.update({
        "in_flight_tree_tasks": wide["makespan_tasks"],
        "in_flight_tree_seconds": wide["makespan_seconds"],
        "in_flight_tree_vs_critical_path": wide["makespan_vs_critical_path"],
        "peak_calls_in_flight": wide["peak_calls_in_flight"],
        "in_flight_idle_rss_mb": wide["makespan_idle_rss_mb"],
        "in_flight_peak_rss_mb": wide["makespan_peak_rss_mb"],
        "rss_per_task_in_flight_kb": wide["rss_per_task_in_flight_kb"],
    })
    figures.update(measure(leads, writers, delay, server, simulate=True))
    # The floor: the same model calls from a process with no engine (see bench.model_floor).
    critical = 2 * delay
    for client in ("official", "bare"):
        floor = model_floor(leads * writers, delay, client)
        figures[f"makespan_floor_{client}_seconds"] = floor["seconds"]
        figures[f"makespan_floor_{client}_vs_critical_path"] = round(floor["seconds"] / critical, 3)
        figures[f"makespan_floor_{client}_cpu_ms_per_call"] = floor["cpu_ms_per_call"]
    figures["makespan_above_floor_seconds"] = round(
        figures["makespan_seconds"] - figures["makespan_floor_official_seconds"], 3)
    return report("makespan", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--leads", type=int, default=30)
    parser.add_argument("--writers", type=int, default=30)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--wide-leads", type=int, default=None)
    a = parser.parse_args()
    main(a.leads, a.writers, a.delay, wide_leads=a.wide_leads)
