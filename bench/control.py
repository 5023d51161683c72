"""Steering a running tree: how fast a cancel is quiet, how tight a pause is, an answer's lag.

    python -m bench.control [--leads 30] [--writers 30] [--delay 1.0] [--answers 20]

The tree is the makespan tree (``bench.makespan``: 1 -> ``leads`` -> ``writers`` async
agents, 931 tasks at the defaults) against the loopback model server
(``bench.model_server``, each call held ``delay`` seconds; it records when each call
starts and counts the calls whose client hung up). One ``orgchart worker`` serves it.

- ``cancel_quiet_seconds``: with several hundred calls in flight, ``orgchart cancel
  ROOT`` is run (the real command, in a process of its own that imported it ahead of time:
  a cold interpreter takes seconds to start on a loaded machine, by which time the tree
  has finished; ``cancel_command_seconds`` is the command's own time); the figure is the
  time from the command returning to the tree being quiet: no open task in the database
  (its last ending write) *and* no call in flight at the model server (the last call's
  end, answered or aborted by the worker); a negative figure: quiet before it returned.
  ``cancel_calls_started_after`` counts the calls the server saw start after the command
  returned (goal 0). Goal for the seconds: <= 1.0.
- ``pause_leak_calls``: on a fresh tree, with calls in flight, ``orgchart pause ROOT``;
  the calls that start more than 1.5 s after the command returned (goal 0).
  ``pause_calls_started_after`` counts every call started after it returned at all.
- ``answer_to_parent_ms``: ``answers`` parents (``bench_asker``) each wait on a question
  to ``human``; each is answered through the Store (what ``orgchart answer`` calls, without
  the process start) and timed until the parent's aggregate is claimed by the waiting
  worker (its status leaves ``ready_to_aggregate``). p50 and p90; goal p50 <= 100 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from bench.common import (
    REPO_ROOT,
    open_store,
    percentile,
    report,
    scratch_database,
    wait_serving,
    worker_env,
)
from bench.makespan import WORKER_BOOT, start_model_server
from runtime.store.rows import NewTask
from runtime.store.store import Store

OPEN = ("pending", "running", "waiting", "ready_to_aggregate", "judging", "awaiting_approval")
CLI = [sys.executable, "-c", "from runtime.cli.app import main; main()"]


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        body: dict[str, Any] = json.loads(resp.read())
    return body


def start_worker(url: str, model_url: str, agents: str) -> subprocess.Popen[str]:
    """One ``orgchart worker`` on the bench agents; returns once it serves."""
    env = worker_env(url)
    env.update({"ORGCHART_LLM__BACKEND": "ollama", "ORGCHART_OLLAMA__URL": model_url,
                "ORGCHART_OLLAMA__MAX_PARALLEL": "2000",
                "ORGCHART_OLLAMA__CLOUD_MAX_PARALLEL": "2000"})
    proc = subprocess.Popen([sys.executable, "-c", WORKER_BOOT, "worker", "--agents", agents,
                             "--agents-module", "bench.agents"],
                            env=env, cwd=str(REPO_ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    wait_serving(proc, lines, 60)
    time.sleep(1.0)
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    """Terminate a process and reap it."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: A process that imports the ``orgchart`` command, then runs the one it reads on stdin:
#: the command's own time, without the interpreter's start (seconds on a loaded machine).
READY_CLI = ("import sys, time; from runtime.cli.app import app; print('ready', flush=True); "
             "args = sys.stdin.readline().split(); t = time.time(); "
             "code = app(args=args, standalone_mode=False); "
             "print('returned', t, time.time(), code or 0, flush=True)")


class Command:
    """``orgchart ARGS`` run in a process started (and importing) ahead of time."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", READY_CLI], env=worker_env(url),
                                     cwd=str(REPO_ROOT), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the command process did not start")

    def run(self, *args: str) -> tuple[float, float]:
        """Run the command; return the wall-clock times it started and returned."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(" ".join(args) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("returned"):
                _, started, returned, code = line.split()
                self.proc.wait(30)
                if code != "0":
                    raise RuntimeError(f"orgchart {' '.join(args)} exited {code}: "
                                       + (self.proc.stderr.read() if self.proc.stderr else ""))
                return float(started), float(returned)
        raise RuntimeError("the command failed: " + (self.proc.stderr.read()
                                                     if self.proc.stderr else ""))


def cli(url: str, *args: str) -> tuple[float, float]:
    """Run one ``orgchart`` command (imported ahead); return when it started and returned."""
    return Command(url).run(*args)


def committed_at(store: Store, root: uuid.UUID, to_status: str) -> float:
    """When the tree's first ``to_status`` event was written (the command's commit)."""
    with store.engine.connect() as conn:
        return float(conn.execute(sa.text(
            "SELECT extract(epoch FROM min(e.at)) FROM task_events e JOIN tasks t "
            "ON t.id = e.task_id WHERE t.root_id = :r AND e.to_status = :s"),
            {"r": root, "s": to_status}).scalar())


def submit_tree(store: Store, leads: int, writers: int) -> uuid.UUID:
    """The makespan tree's root, with a budget that never binds."""
    root, _ = store.tasks.submit(NewTask(to_agent="mk_planner", type="task",
                                         payload={"goal": "control", "leads": leads,
                                                  "writers": writers},
                                         budget_tokens=10_000_000, budget_usd=Decimal(1000)))
    return root["id"]  # type: ignore[no-any-return]


def wait_in_flight(model_url: str, at_least: int, seconds: float = 120) -> int:
    """Wait until the model server holds ``at_least`` calls; return how many it holds."""
    deadline = time.monotonic() + seconds
    peak, stats = 0, {}
    while time.monotonic() < deadline:
        stats = _get(model_url + "/stats")
        now = int(stats["in_flight"])
        if now >= at_least:
            return now
        peak = max(peak, now)
        time.sleep(0.01)
    raise RuntimeError(f"fewer than {at_least} calls in flight after {seconds} s "
                       f"(at most {peak}; the model server's last stats: {stats})")


def open_tasks(store: Store, root: uuid.UUID) -> int:
    """Tasks of the tree not yet in a terminal status."""
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM tasks WHERE root_id = :r AND status = ANY(:open)"),
            {"r": root, "open": list(OPEN)}).scalar() or 0)


def measure_cancel(url: str, store: Store, model_url: str, leads: int, writers: int,
                   in_flight: int) -> dict[str, Any]:
    """Cancel the tree with calls in flight; time until it is quiet; count late calls."""
    _get(model_url + "/stats/reset")
    command = Command(url)  # imported before the tree starts
    root = submit_tree(store, leads, writers)
    held = wait_in_flight(model_url, in_flight)
    launched, returned = command.run("cancel", str(root), "--note", "bench")
    time.sleep(3.0)  # every call in flight ends (1 s each); anything that would start, starts
    seen = _get(model_url + "/starts")
    starts, aborts, ends = seen["starts"], seen["aborts"], seen["ends"]
    stats = _get(model_url + "/stats")
    commit = committed_at(store, root, "cancelled")
    with store.engine.connect() as conn:
        statuses = dict(conn.execute(sa.text(
            "SELECT status, count(*) FROM tasks WHERE root_id = :r GROUP BY status"),
            {"r": root}).all())
        # The last write that ended a task of the tree (the database's view of "quiet").
        last_end = float(conn.execute(sa.text(
            "SELECT extract(epoch FROM max(e.at)) FROM task_events e JOIN tasks t "
            "ON t.id = e.task_id WHERE t.root_id = :r AND e.to_status = ANY(:final)"),
            {"r": root, "final": ["done", "failed", "escalated", "cancelled"]}).scalar())
        paid_after = conn.execute(sa.text(
            "SELECT count(*) FROM model_calls WHERE root_id = :r AND NOT replayed "
            "AND created_at - make_interval(secs => duration_seconds) > to_timestamp(:t)"),
            {"r": root, "t": returned}).scalar()
    if open_tasks(store, root):
        raise RuntimeError(f"the tree has open tasks 3 s after the cancel: {statuses}")
    # The server's view: when the last call of the tree ended (answered or aborted).
    quiet_server = max([*aborts, *ends, commit])
    return {
        "cancel_calls_in_flight_at_cancel": held,
        # quiet: no open task (the last ending write) and no call in flight (the last
        # call's end at the server), from the command's return; <= 0 means quiet before
        "cancel_quiet_seconds": round(max(last_end, quiet_server) - returned, 3),
        "cancel_db_quiet_seconds": round(last_end - returned, 3),
        "cancel_server_quiet_seconds": round(quiet_server - returned, 3),
        "cancel_command_seconds": round(returned - launched, 3),
        "cancel_calls_started_after": sum(1 for s in starts if s > returned),
        "cancel_calls_started_after_commit": sum(1 for s in starts if s > commit),
        "cancel_calls_aborted_at_server": int(stats["aborted"]),
        # the worker's own stop time: the cancel's commit to the last call it aborted
        "cancel_commit_to_last_abort_seconds": (round(max(aborts) - commit, 3)
                                                if aborts else None),
        "cancel_calls_paid_started_after": int(paid_after or 0),
        "cancel_tree_statuses": statuses,
    }


def measure_pause(url: str, store: Store, model_url: str, leads: int, writers: int,
                  in_flight: int, delay: float) -> dict[str, Any]:
    """Pause the tree with calls in flight; count the calls that start afterwards."""
    _get(model_url + "/stats/reset")
    command = Command(url)  # imported before the tree starts
    root = submit_tree(store, leads, writers)
    held = wait_in_flight(model_url, in_flight)
    _, returned = command.run("pause", str(root), "--note", "bench")
    time.sleep(max(4.0, 3 * delay))
    starts = _get(model_url + "/starts")["starts"]
    in_flight_later = int(_get(model_url + "/stats")["in_flight"])
    resuming, _ = cli(url, "resume", str(root))
    deadline = time.monotonic() + 60
    while store.reads.get(root)["status"] not in ("done", "failed", "escalated", "cancelled"):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    resumed_calls = sum(1 for s in _get(model_url + "/starts")["starts"] if s > resuming)
    finished = store.reads.get(root)["status"]
    return {
        "pause_calls_in_flight_at_pause": held,
        "pause_leak_calls": sum(1 for s in starts if s > returned + 1.5),
        "pause_calls_started_after": sum(1 for s in starts if s > returned),
        "pause_calls_in_flight_after_4s": in_flight_later,
        "pause_calls_started_after_resume": resumed_calls,
        "pause_tree_after_resume": finished,
    }


def measure_answers(store: Store, answers: int) -> dict[str, Any]:
    """Answer ``answers`` questions one by one; time each until its parent is claimed."""
    parents = [store.tasks.submit(NewTask(to_agent="bench_asker", type="task",
                                          payload={"goal": f"ask {i}"}))[0]["id"]
               for i in range(answers)]
    deadline = time.monotonic() + 120
    questions: dict[uuid.UUID, uuid.UUID] = {}
    while len(questions) < answers and time.monotonic() < deadline:
        for p in parents:
            kids = store.reads.children(p)
            if kids and p not in questions:
                questions[p] = kids[0]["id"]
        time.sleep(0.05)
    time.sleep(0.5)  # the worker is idle, waiting
    lags: list[float] = []
    for parent, question in questions.items():
        started = time.monotonic()
        store.steering.answer(question, "yes", actor="bench")
        while store.reads.get(parent)["status"] in ("ready_to_aggregate", "waiting"):
            if time.monotonic() - started > 30:
                raise RuntimeError("an answered question's parent was never claimed")
            time.sleep(0.001)
        lags.append((time.monotonic() - started) * 1000)
        time.sleep(0.1)
    return {"answer_samples": len(lags),
            "answer_to_parent_ms": round(statistics.median(lags), 1),
            "answer_to_parent_p90_ms": round(percentile(lags, 90), 1)}


def main(leads: int = 30, writers: int = 30, delay: float = 1.0, answers: int = 20,
         in_flight: int = 300, server: str | None = None) -> dict[str, Any]:
    """Run the three measurements (each tree in the same scratch database); print them."""
    figures: dict[str, Any] = {"control_tree_tasks": 1 + leads + leads * writers,
                               "control_model_delay_seconds": delay}
    with scratch_database("control", server) as url:
        model_proc, model_url = start_model_server(delay)
        worker = start_worker(url, model_url, "mk_planner,mk_lead,mk_writer,bench_asker,judge")
        store = open_store(url)
        try:
            figures.update(measure_cancel(url, store, model_url, leads, writers, in_flight))
            figures.update(measure_pause(url, store, model_url, leads, writers, in_flight,
                                         delay))
            figures.update(measure_answers(store, answers))
        except RuntimeError as exc:
            state = "runs" if worker.poll() is None else f"exited {worker.returncode}"
            raise RuntimeError(f"{exc} (the worker {state})") from exc
        finally:
            stop(worker)
            model_proc.kill()
            model_proc.wait()
            store.dispose()
    return report("control", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--leads", type=int, default=30)
    parser.add_argument("--writers", type=int, default=30)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--answers", type=int, default=20)
    parser.add_argument("--in-flight", type=int, default=300)
    args = parser.parse_args()
    out = main(args.leads, args.writers, args.delay, args.answers, args.in_flight)
    print(json.dumps(out, default=str))
