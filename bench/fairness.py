"""Fair scheduling between trees and tenants (issue 25): three figures.

    python -m bench.fairness [--wide 2000] [--delay 0.2] [--window 30]

Each against the loopback model server (``bench.model_server``, every call held
``delay`` seconds), with ``orgchart worker`` processes at their default settings (model
limits included: ``[ollama] max_parallel`` = ``cloud_max_parallel`` = 8), each in a
scratch database of its own. The trees are ``fair_root`` (``bench.agents``): a root that
delegates ``writers`` writers (one model call each) and aggregates with one call.

- ``fair_small_tree_ratio``: a 4-task tree (3 writers and the aggregate call) submitted
  3 s after a ``wide``-writer tree of another tenant, then twice more (1 s after the
  previous one ended, the wide tree still running); the median of its makespans (the
  root's ``completed_at - created_at``) divided by the median of three runs alone on the
  same worker before the wide tree (``..._ratio_first``: the first one's). Goal <= 1.5.
- ``fair_share_error``: tenants ``heavy`` (weight 3) and ``light`` (weight 1), each a
  tree of ``share_writers`` equal calls submitted together; over ``window`` seconds after
  a warm-up of 5 s (``window`` if shorter), each tenant's share of the tokens of the
  calls made, against 75/25;
  the figure is the larger distance in percentage points. Goal <= 5.
- ``fair_cost_share_error``: tenants ``cheap`` and ``dear`` of equal weight, each a tree
  of ``share_writers`` writers, the dear one's prompts padded to about 10x the tokens
  (``[scheduler] fair_quantum_tokens`` = a cheap call's tokens, ``max_wait_seconds`` =
  3600), on a worker that has made calls before (a 4-task tree first); over ``window``
  seconds after a warm-up of 5 s, each tenant's share of the tokens, against 50/50; the
  figure is the distance in points (claiming by task count gives about 41).
- ``tenant_limit_overrun``: ``[tenants.capped] max_in_flight = 10``, 3 worker processes,
  one tree of ``limit_writers`` writers of that tenant; every 50 ms, the tenant's running
  tasks (live leases) and the model server's calls in flight; the figure is the largest
  count over 10 (goal 0), with both maxima printed.
- ``tenant_tokens_per_minute_overrun``: ``[tenants.metered] tokens_per_minute =
  token_rate``, 2 worker processes, one tree of ``limit_writers`` writers of that tenant,
  for ``window`` seconds from its submission; from the ``model_calls`` rows (tokens and
  times), the most tokens any stretch of calls spent beyond what the bucket allows over it
  (one minute's worth, plus the rate times the stretch and the model's ``delay``: a call
  is charged when it ends, ``delay`` after its tokens were taken). Goal 0. Printed beside
  it: the limit, the rate measured after the first minute's worth, the window.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.common import REPO_ROOT, open_store, report, scratch_database, wait_serving, worker_env
from bench.makespan import WORKER_BOOT, start_model_server
from runtime.store.rows import NewTask
from runtime.store.store import Store

AGENTS = "fair_root,mk_planner,mk_lead,mk_writer,judge"
#: About what one cheap writer's call costs (its prompt and 4 completion tokens): the
#: ``[scheduler] fair_quantum_tokens`` of fair_cost_share_error.
CHEAP_CALL_TOKENS = 10


def start_worker(url: str, model_url: str, config: Path) -> subprocess.Popen[str]:
    """One ``orgchart worker`` at its defaults with ``config``; returns once it serves."""
    env = worker_env(url)
    env.update({"ORGCHART_LLM__BACKEND": "ollama", "ORGCHART_OLLAMA__URL": model_url,
                "ORGCHART_CONFIG": str(config)})
    proc = subprocess.Popen([sys.executable, "-c", WORKER_BOOT, "worker", "--agents", AGENTS,
                             "--agents-module", "bench.agents"],
                            env=env, cwd=str(REPO_ROOT), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    wait_serving(proc, lines, 90)
    return proc


def stop(procs: list[subprocess.Popen[str]]) -> None:
    """Terminate processes and reap them."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def submit(store: Store, writers: int, tenant: str, leads: int = 0, pad: int = 0) -> uuid.UUID:
    """Under ``tenant`` (budgets never bind): a ``fair_root`` tree of ``writers`` writers,
    or with ``leads``, the makespan tree (1 -> leads -> writers each: ``[policies]
    max_children`` is 50; ``pad`` characters more in each writer's prompt)."""
    agent = "mk_planner" if leads else "fair_root"
    root, _ = store.tasks.submit(NewTask(to_agent=agent, type="task",
                                         payload={"goal": f"fair {tenant}", "writers": writers,
                                                  "leads": leads, "pad": pad},
                                         budget_tokens=100_000_000, budget_usd=Decimal(100_000),
                                         tenant=tenant))
    return root["id"]  # type: ignore[no-any-return]


def makespan(store: Store, root: uuid.UUID, timeout: float = 300.0) -> float:
    """Wait for the root to finish; its ``completed_at - created_at`` in seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = store.reads.get(root)
        if row["status"] in ("done", "failed", "escalated", "cancelled"):
            if row["status"] != "done":
                raise RuntimeError(f"tree {root} ended {row['status']}: {row.get('error')}")
            return float((row["completed_at"] - row["created_at"]).total_seconds())
        time.sleep(0.01)
    raise RuntimeError(f"tree {root} did not finish in {timeout} s")


def _config(tmp: Path, text: str) -> Path:
    path = tmp / f"fair-{uuid.uuid4().hex[:8]}.toml"
    path.write_text(text)
    return path


def small_tree_ratio(tmp: Path, delay: float, wide: int,
                     server: str | None = None) -> dict[str, Any]:
    """fair_small_tree_ratio: the small tree alone, then 3 s after the wide tree."""
    with scratch_database("fair_small", server) as url:
        model_proc, model_url = start_model_server(delay)
        worker = start_worker(url, model_url, _config(tmp, ""))
        store = open_store(url)
        try:
            alone = [makespan(store, submit(store, 3, "small")) for _ in range(3)]
            wide_root = submit(store, 45, "big", leads=min(45, max(1, wide // 45)))
            time.sleep(3.0)
            besides = []
            for _ in range(3):  # 3 s after the wide tree, then 1 s after each ended
                besides.append(makespan(store, submit(store, 3, "small")))
                time.sleep(1.0)
            wide_done = store.reads.get(wide_root)["status"]
        finally:
            stop([worker])
            model_proc.kill()
            model_proc.wait()
            store.dispose()
    base, beside = statistics.median(alone), statistics.median(besides)
    return {"fair_small_tree_alone_seconds": round(base, 3),
            "fair_small_tree_beside_wide_seconds": round(beside, 3),
            "fair_small_tree_beside_runs_seconds": [round(b, 3) for b in besides],
            "fair_small_tree_ratio_first": round(besides[0] / base, 3),
            "fair_wide_tree_tasks": 1 + min(45, max(1, wide // 45)) * 46,
            "fair_wide_tree_status_then": wide_done,
            "fair_small_tree_ratio": round(beside / base, 3)}


def share_error(tmp: Path, delay: float, writers: int, window: float,
                server: str | None = None) -> dict[str, Any]:
    """fair_share_error: weights 3 and 1, deep backlogs of equal calls, over ``window`` s."""
    config = _config(tmp, "[tenants.heavy]\nweight = 3\n[tenants.light]\nweight = 1\n")
    with scratch_database("fair_share", server) as url:
        model_proc, model_url = start_model_server(delay)
        worker = start_worker(url, model_url, config)
        store = open_store(url)
        try:
            leads = min(45, max(1, writers // 45))  # [policies] max_children is 50
            submit(store, 45, "heavy", leads=leads)
            submit(store, 45, "light", leads=leads)
            time.sleep(min(5.0, window))  # warm-up
            start = time.time()
            time.sleep(window)
            with store.engine.connect() as conn:
                rows = dict(conn.execute(sa.text(
                    "SELECT t.tenant, sum(m.prompt_tokens + m.completion_tokens) "
                    "FROM model_calls m JOIN tasks t ON t.id = m.task_id "
                    "WHERE m.created_at >= to_timestamp(:a) "
                    "AND m.created_at < to_timestamp(:b) "
                    "GROUP BY t.tenant"), {"a": start, "b": start + window}).all())
        finally:
            stop([worker])
            model_proc.kill()
            model_proc.wait()
            store.dispose()
    heavy, light = int(rows.get("heavy") or 0), int(rows.get("light") or 0)
    if not heavy + light:
        raise RuntimeError("no model call was made in the window: the trees did not run")
    share = heavy / (heavy + light) if heavy + light else 0.0
    return {"fair_share_window_seconds": window, "fair_share_tokens": {"heavy": heavy,
                                                                       "light": light},
            "fair_share_heavy_percent": round(share * 100, 2),
            "fair_share_error": round(abs(share - 0.75) * 100, 2)}


def cost_share_error(tmp: Path, delay: float, writers: int, window: float, pad: int = 330,
                     server: str | None = None) -> dict[str, Any]:
    """fair_cost_share_error: equal weights, one tenant's calls about 10x the other's."""
    # max_wait_seconds: the dear tree's 2,000 tasks, ten steps apart, span 10,000 s of fair
    # time; at the default (300 s) all but its first 60 would be capped at their creation
    # plus 300 s, and taken in creation order beside the cheap tree's.
    config = _config(tmp, f"[scheduler]\nfair_quantum_tokens = {CHEAP_CALL_TOKENS}\n"
                          "max_wait_seconds = 3600\n")
    with scratch_database("fair_cost", server) as url:
        model_proc, model_url = start_model_server(delay)
        worker = start_worker(url, model_url, config)
        store = open_store(url)
        try:
            # A worker that has made calls (as a fleet's long-lived ones have): it claims
            # by its model slots. A fresh one claims up to max_in_flight before its first
            # call, so the dear tree's first few hundred tasks would go before its cost
            # is known.
            makespan(store, submit(store, 3, "warm"))
            leads = min(45, max(1, writers // 45))
            submit(store, 45, "cheap", leads=leads)
            submit(store, 45, "dear", leads=leads, pad=pad)
            time.sleep(min(5.0, window))  # warm-up
            start = time.time()
            time.sleep(window)
            with store.engine.connect() as conn:
                rows = {r[0]: (int(r[1]), int(r[2])) for r in conn.execute(sa.text(
                    "SELECT t.tenant, sum(m.prompt_tokens + m.completion_tokens), count(*) "
                    "FROM model_calls m JOIN tasks t ON t.id = m.task_id "
                    "WHERE m.created_at >= to_timestamp(:a) "
                    "AND m.created_at < to_timestamp(:b) "
                    "GROUP BY t.tenant"), {"a": start, "b": start + window})}
        finally:
            stop([worker])
            model_proc.kill()
            model_proc.wait()
            store.dispose()
    (cheap, cheap_calls), (dear, dear_calls) = rows.get("cheap", (0, 0)), rows.get("dear", (0, 0))
    if not cheap_calls or not dear_calls:
        raise RuntimeError(f"a tenant made no call in the window: {rows}")
    share = cheap / (cheap + dear)
    return {"fair_cost_window_seconds": window,
            "fair_cost_tokens_per_call": {"cheap": round(cheap / cheap_calls, 1),
                                          "dear": round(dear / dear_calls, 1)},
            "fair_cost_calls": {"cheap": cheap_calls, "dear": dear_calls},
            "fair_cost_tokens": {"cheap": cheap, "dear": dear},
            "fair_cost_cheap_percent": round(share * 100, 2),
            "fair_cost_share_error": round(abs(share - 0.5) * 100, 2)}


def limit_overrun(tmp: Path, delay: float, writers: int, cap: int = 10,
                  workers: int = 3, server: str | None = None) -> dict[str, Any]:
    """tenant_limit_overrun: ``max_in_flight = cap`` across ``workers`` processes."""
    config = _config(tmp, f"[tenants.capped]\nmax_in_flight = {cap}\n")
    with scratch_database("fair_limit", server) as url:
        model_proc, model_url = start_model_server(delay)
        procs = [start_worker(url, model_url, config) for _ in range(workers)]
        store = open_store(url)
        peak_running = peak_calls = samples = 0
        try:
            root = submit(store, 20, "capped", leads=min(45, max(1, writers // 20)))
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                with store.engine.connect() as conn:
                    running = int(conn.execute(sa.text(
                        "SELECT count(*) FROM tasks WHERE tenant = 'capped' AND "
                        "status = 'running' AND lease_expires_at > now()")).scalar_one())
                calls = _in_flight(model_url)
                peak_running, peak_calls = max(peak_running, running), max(peak_calls, calls)
                samples += 1
                if store.reads.get(root)["status"] in ("done", "failed", "escalated"):
                    break
                time.sleep(0.05)
            status = store.reads.get(root)["status"]
        finally:
            stop(procs)
            model_proc.kill()
            model_proc.wait()
            store.dispose()
    return {"tenant_limit_max_in_flight": cap, "tenant_limit_workers": workers,
            "tenant_limit_samples": samples, "tenant_limit_tree_status": status,
            "tenant_limit_peak_running": peak_running,
            "tenant_limit_peak_model_calls": peak_calls,
            "tenant_limit_overrun": max(0, peak_running - cap, peak_calls - cap)}


def token_rate_overrun(tmp: Path, delay: float, writers: int, window: float,
                       rate: int = 1200, workers: int = 2,
                       server: str | None = None) -> dict[str, Any]:
    """tenant_tokens_per_minute_overrun: ``tokens_per_minute = rate`` across ``workers``."""
    config = _config(tmp, f"[tenants.metered]\ntokens_per_minute = {rate}\n")
    with scratch_database("fair_tokens", server) as url:
        model_proc, model_url = start_model_server(delay)
        procs = [start_worker(url, model_url, config) for _ in range(workers)]
        store = open_store(url)
        try:
            start = time.time()
            submit(store, 20, "metered", leads=min(45, max(1, writers // 20)))
            time.sleep(window)
            with store.engine.connect() as conn:
                calls = [(float(r[0]), int(r[1])) for r in conn.execute(sa.text(
                    "SELECT extract(epoch FROM m.created_at), "
                    "m.prompt_tokens + m.completion_tokens "
                    "FROM model_calls m JOIN tasks t ON t.id = m.task_id "
                    "WHERE t.tenant = 'metered' AND m.created_at < to_timestamp(:b) "
                    "ORDER BY m.created_at"), {"b": start + window})]
        finally:
            stop(procs)
            model_proc.kill()
            model_proc.wait()
            store.dispose()
    if not calls:
        raise RuntimeError("no metered model call was made: the tree did not run")
    overrun = 0.0
    for i, (a, _) in enumerate(calls):  # every stretch of calls, from call i to call j
        used = 0
        for b, tokens in calls[i:]:
            used += tokens
            overrun = max(overrun, used - (rate + rate / 60 * (b - a + delay)))
    total = sum(t for _, t in calls)
    span = max(calls[-1][0] - start, 1e-9)
    return {"tenant_tokens_per_minute_limit": rate, "tenant_tokens_window_seconds": window,
            "tenant_tokens_workers": workers, "tenant_tokens_calls": len(calls),
            "tenant_tokens_used": total,
            "tenant_tokens_per_minute_measured": round(max(0, total - rate) / span * 60, 1),
            "tenant_tokens_per_minute_overrun": round(overrun, 1)}


def _in_flight(model_url: str) -> int:
    """The model server's calls in flight now."""
    with urllib.request.urlopen(model_url + "/stats", timeout=10) as resp:
        return int(json.loads(resp.read())["in_flight"])


#: The measurements, by the name ``--only`` takes.
PARTS = ("small", "share", "cost", "limit", "tokens")


def main(wide: int = 2000, delay: float = 0.2, window: float = 30.0,
         share_writers: int = 2025, limit_writers: int = 200,
         server: str | None = None, only: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """Run the measurements (all, or those ``only`` names); print them."""
    figures: dict[str, Any] = {"fair_model_delay_seconds": delay}
    with tempfile.TemporaryDirectory(prefix="orgchart-fair-") as tmp:
        if "small" in only:
            figures.update(small_tree_ratio(Path(tmp), delay, wide, server))
        if "share" in only:
            figures.update(share_error(Path(tmp), delay, share_writers, window, server))
        if "cost" in only:
            figures.update(cost_share_error(Path(tmp), delay, share_writers, window,
                                            server=server))
        if "limit" in only:
            figures.update(limit_overrun(Path(tmp), delay, limit_writers, server=server))
        if "tokens" in only:
            figures.update(token_rate_overrun(Path(tmp), delay, 500, window, server=server))
    return report("fairness", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wide", type=int, default=2000)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--share-writers", type=int, default=2025)
    parser.add_argument("--limit-writers", type=int, default=200)
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"a comma-separated subset of {','.join(PARTS)}")
    args = parser.parse_args()
    out = main(args.wide, args.delay, args.window, args.share_writers, args.limit_writers,
               only=tuple(p.strip() for p in args.only.split(",")))
    print(json.dumps(out, default=str))
