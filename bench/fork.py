"""Forks: what a branch pays, counted at the model server, and how fast a full replay runs.

    python -m bench.fork [--leads 30] [--writers 30] [--delay 1.0]

One ``orgchart worker`` process (default settings, ``[ollama] max_parallel`` raised as in
``bench.makespan``) against ``bench.model_server`` on loopback, which counts the requests
it answers: the paid calls are counted there, not in our tables.

- ``fork_paid_calls``: a planner with 3 writers (one call each) and an aggregate call that
  quotes the writers (``tests/fork_agents.py``). Forking one writer with a new payload
  must pay exactly 2 calls (that writer's and the aggregate's) and replay 2
  (``fork_replayed_calls``, from ``model_calls``).
- ``rerun_paid_calls``: an unchanged re-run (``orgchart fork ROOT``) of the finished
  931-task tree of ``bench.makespan`` must pay 0 calls (summed over the rounds).
  ``rerun_makespan_seconds`` is the time from the fork to the branch's root ending,
  every call replayed; ``noop_makespan_seconds`` the same tree with agents that do no
  model call (they return at once); ``rerun_vs_noop`` divides the two (goal <= 1.2).
  Three rounds, alternating a no-op tree and a re-run; the best of each (the machine is
  shared), with every sample and the ratio of the medians (``rerun_vs_noop_median``).
- ``rerun_worker_cpu_ms_per_task`` / ``noop_worker_cpu_ms_per_task``: the worker
  process's CPU per task of the tree (median of the rounds), and the server's
  (``..._server_cpu_ms_per_task``, every backend of the server: other clients' work
  counts too): what a replayed call costs beside a no-op, less moved by the machine's
  load than the makespans.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import uuid
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from bench.common import (
    REPO_ROOT,
    open_store,
    proc_cpu_seconds,
    report,
    scratch_database,
    server_cpu_seconds,
    wait_serving,
    worker_env,
)
from bench.makespan import WORKER_BOOT, start_model_server
from runtime.config import load_settings
from runtime.forks import fork
from runtime.store.rows import NewTask
from runtime.store.store import Store
from runtime.wiring import load_registry

MODULES = ("bench.agents", "tests.fork_agents")
AGENTS = "mk_planner,mk_lead,mk_writer,fork_planner,fork_writer,judge"
TERMINAL = ("done", "failed", "escalated", "cancelled")
#: A no-op agent's "model call": the makespan agents sleep this long instead (``simulate``).
NOOP_SECONDS = 1e-6


def _answered(model_url: str) -> int:
    import json
    import urllib.request

    with urllib.request.urlopen(model_url + "/stats", timeout=5) as resp:
        return int(json.loads(resp.read())["answered"])


def _start_worker(url: str, model_url: str) -> tuple[subprocess.Popen[str], list[str]]:
    env = worker_env(url)
    env.update({"ORGCHART_LLM__BACKEND": "ollama", "ORGCHART_OLLAMA__URL": model_url,
                "ORGCHART_OLLAMA__MAX_PARALLEL": "2000",
                "ORGCHART_OLLAMA__CLOUD_MAX_PARALLEL": "2000"})
    modules = [arg for m in MODULES for arg in ("--agents-module", m)]
    proc = subprocess.Popen([sys.executable, "-c", WORKER_BOOT, "worker", "--agents", AGENTS,
                             *modules], env=env, cwd=str(REPO_ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    wait_serving(proc, lines, 60)
    time.sleep(1.0)  # its LISTEN connection and first poll
    return proc, lines


def _wait(store: Store, root_id: uuid.UUID, lines: list[str], limit: float = 600) -> float:
    """Seconds until the root ends (it must end ``done``)."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        status = store.reads.get(root_id)["status"]
        if status in TERMINAL:
            if status != "done":
                raise RuntimeError(f"root {root_id} ended {status}\n" + "".join(lines[-30:]))
            return time.monotonic() - started
        time.sleep(0.01)
    raise RuntimeError(f"root {root_id} did not end in {limit}s\n" + "".join(lines[-30:]))


def _calls(store: Store, root_id: uuid.UUID) -> tuple[int, int]:
    with store.engine.connect() as conn:
        paid, replayed = conn.execute(sa.text(
            "SELECT count(*) FILTER (WHERE NOT replayed), count(*) FILTER (WHERE replayed) "
            "FROM model_calls WHERE root_id = :r"), {"r": root_id}).one()
    return int(paid), int(replayed)


def _submit(store: Store, agent: str, payload: dict[str, Any]) -> uuid.UUID:
    task, _ = store.tasks.submit(NewTask(to_agent=agent, type="task", payload=payload,
                                         budget_tokens=10_000_000, budget_usd=Decimal(1000)))
    return uuid.UUID(str(task["id"]))


def measure(leads: int, writers: int, delay: float, server: str | None) -> dict[str, Any]:
    """Both measures on one worker and one model server; return the figures."""
    with scratch_database("fork", server) as url:
        settings = load_settings(env={"ORGCHART_DATABASE_URL": url,
                                      "ORGCHART_CONFIG": worker_env(url)["ORGCHART_CONFIG"]})
        registry = load_registry(settings, list(MODULES))
        model_proc, model_url = start_model_server(delay)
        worker, lines = _start_worker(url, model_url)
        store = open_store(url)
        try:
            figures = _fork_one_writer(store, registry, settings, model_url, lines)
            figures.update(_rerun(store, registry, settings, model_url, lines, leads,
                                  writers, delay, _Cpu(worker.pid, url)))
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
    return figures


def _fork_one_writer(store: Store, registry: Any, settings: Any, model_url: str,
                     lines: list[str]) -> dict[str, Any]:
    root = _submit(store, "fork_planner", {"goal": "harbour report", "parts": 3})
    _wait(store, root, lines)
    original_paid = _answered(model_url)
    writer = next(c for c in store.reads.children(root) if c["idempotency_key"] == "w1")
    branch = fork(store, registry, settings, writer["id"], actor="bench",
                  payload={"goal": "the lighthouse at night"})
    _wait(store, branch["id"], lines)
    paid_at_server = _answered(model_url) - original_paid
    ours_paid, replayed = _calls(store, branch["id"])
    return {"fork_original_paid_calls": original_paid,
            "fork_paid_calls": paid_at_server,
            "fork_paid_calls_in_model_calls": ours_paid,
            "fork_replayed_calls": replayed}


class _Cpu:
    """CPU seconds of the worker process and of the server, sampled around each tree."""

    def __init__(self, pid: int, url: str) -> None:
        self.pid, self.url = pid, url
        self.samples: dict[str, list[tuple[float, float]]] = {"noop": [], "rerun": []}
        self._at = (0.0, 0.0)

    def _now(self) -> tuple[float, float]:
        return proc_cpu_seconds(self.pid), server_cpu_seconds(self.url) or 0.0

    def start(self) -> None:
        """Before a tree."""
        self._at = self._now()

    def stop(self, kind: str) -> None:
        """After a tree of ``kind`` (``noop`` or ``rerun``)."""
        worker, server = self._now()
        self.samples[kind].append((worker - self._at[0], server - self._at[1]))

    def figures(self, tasks: int) -> dict[str, Any]:
        """Median CPU milliseconds per task of each kind, the worker's and the server's."""
        out: dict[str, Any] = {}
        for kind, samples in self.samples.items():
            for i, side in enumerate(("worker", "server")):
                out[f"{kind}_{side}_cpu_ms_per_task"] = round(
                    statistics.median(s[i] for s in samples) * 1000 / tasks, 4)
        return out


def _rerun(store: Store, registry: Any, settings: Any, model_url: str, lines: list[str],
           leads: int, writers: int, delay: float, cpu: _Cpu,
           rounds: int = 3) -> dict[str, Any]:
    """The original tree once; then, ``rounds`` times, a no-op tree and a re-run, in turn.

    The machine is shared: each figure is the best of its rounds (every sample is
    printed too), and the two kinds alternate so neither gets the quieter moments.
    """
    shape = {"goal": "makespan", "leads": leads, "writers": writers}
    tasks = 1 + leads + leads * writers
    root = _submit(store, "mk_planner", {**shape, "simulate": None})
    original_seconds = _wait(store, root, lines)
    reruns: list[float] = []
    noops: list[float] = []
    paid_at_server = replayed = 0
    for _ in range(rounds):
        cpu.start()
        noop = _submit(store, "mk_planner", {**shape, "simulate": NOOP_SECONDS})
        noops.append(_wait(store, noop, lines))
        cpu.stop("noop")
        before = _answered(model_url)
        cpu.start()
        branch = fork(store, registry, settings, root, actor="bench")
        reruns.append(_wait(store, branch["id"], lines))
        cpu.stop("rerun")
        paid_at_server += _answered(model_url) - before
        replayed += _calls(store, branch["id"])[1]
    return {"rerun_tree_tasks": tasks,
            "rerun_model_delay_seconds": delay,
            "rerun_original_makespan_seconds": round(original_seconds, 3),
            "rerun_rounds": rounds,
            "rerun_paid_calls": paid_at_server,
            "rerun_replayed_calls": replayed,
            "rerun_makespan_seconds": round(min(reruns), 3),
            "noop_makespan_seconds": round(min(noops), 3),
            "rerun_vs_noop": round(min(reruns) / min(noops), 3),
            "rerun_vs_noop_median": round(statistics.median(reruns)
                                          / statistics.median(noops), 3),
            "rerun_makespan_samples": [round(x, 3) for x in reruns],
            "noop_makespan_samples": [round(x, 3) for x in noops],
            **cpu.figures(tasks)}


def main(leads: int = 30, writers: int = 30, delay: float = 1.0,
         server: str | None = None) -> dict[str, Any]:
    """Measure and print the figures (see the module docstring)."""
    return report("fork", measure(leads, writers, delay, server))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--leads", type=int, default=30)
    parser.add_argument("--writers", type=int, default=30)
    parser.add_argument("--delay", type=float, default=1.0)
    a = parser.parse_args()
    main(a.leads, a.writers, a.delay)
