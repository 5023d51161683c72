"""Acceptance: real ``orgchart worker`` processes, SIGKILLed and SIGTERMed mid-task.

Goals go in through ``orgchart submit`` subprocesses; workers run with a 2-second lease so
a dead worker's tasks come back within seconds. What must hold afterwards: every tree is
finished, each task has exactly one terminal transition, the dead worker's tasks were
reaped and finished by someone else, and no parent has the same child twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.store.store import Store
from tests.chaos.helpers import (
    Fleet,
    WorkerProc,
    after_reaping,
    cli_env,
    duplicate_children,
    events_of,
    held_at_death,
    held_by,
    status_counts,
    submit_goals,
    unfinished,
    wait_until,
)
from tests.factories import terminal_event_counts

MODULE = "tests.support_agents"
LEASE_SECONDS = 2
ROOTS = 3
CHILDREN = 6
DRAIN_TIMEOUT = 60.0


@pytest.fixture
def env(orgchart_env: dict[str, str]) -> dict[str, str]:
    return cli_env(orgchart_env)


@pytest.fixture
def fleet(env: dict[str, str], tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(env, tmp_path / "workers",
               ["--agents-module", MODULE, "--lease-seconds", str(LEASE_SECONDS)]) as f:
        yield f


def _logs(fleet: Fleet) -> str:
    return "\n".join(f"--- worker {w.number} (pid {w.pid}, rc {w.proc.poll()}):\n{w.log()}"
                     for w in fleet.workers)


def test_a_sigkilled_workers_tasks_are_reaped_and_finished_once_by_another(
        env: dict[str, str], fleet: Fleet, store: Store) -> None:
    roots = submit_goals(env, [(f"acceptance {i}", "fanout",
                                {"n": CHILDREN, "sleep": 0.3}) for i in range(ROOTS)],
                         modules=[MODULE])
    assert all(r["created"] and r["status"] == "pending" for r in roots)

    workers = [fleet.start(), fleet.start()]

    def busy() -> WorkerProc | None:
        """The first worker caught holding a running (sleeping) echo task."""
        return next((w for w in workers if any(
            t["status"] == "running" and t["to_agent"] == "echo"
            for t in held_by(store, w.pid))), None)

    victim = wait_until(busy, 30, "a worker to hold a running echo task")
    fleet.sigkill(victim)
    held = held_at_death(store, victim.pid)  # exactly what it held when it died
    assert held, "the killed worker held nothing when it died"
    victim_id = held[0]["lease_owner"]
    fleet.start()  # a replacement

    wait_until(lambda: unfinished(store) == 0, DRAIN_TIMEOUT,
               f"every task to finish; now {dict(status_counts(store))}\n{_logs(fleet)}")

    # Every tree finished, and finished well: nothing was lost or failed by the crash.
    assert status_counts(store) == {"done": ROOTS * (1 + CHILDREN)}, _logs(fleet)
    for root in roots:
        row = store.reads.get(root["id"])
        assert row["status"] == "done" and row["result"] == {"parts": CHILDREN}
        assert len(store.reads.children(root["id"])) == CHILDREN
    # Exactly one terminal transition per task.
    counts = terminal_event_counts(store)
    assert len(counts) == ROOTS * (1 + CHILDREN)
    assert {tid: n for tid, n in counts.items() if n != 1} == {}
    # No parent got the same child twice.
    assert duplicate_children(store) == []
    # What the dead worker held: its session ended (or its lease expired), the reaper
    # released it, and another worker claimed it and wrote its outcome.
    for task in held:
        after = after_reaping(store, task["id"])
        assert all(e["worker"] != victim_id for e in after), after
        if task["status"] == "running":
            claims = [e for e in after if e["to_status"] == "running"]
            assert claims and claims[0]["worker"] not in ("reaper", victim_id), after
        assert store.reads.get(task["id"])["status"] == "done"
    assert not fleet.unexpected_exits(), _logs(fleet)


def test_sigterm_lets_a_worker_finish_what_it_holds_and_exit_zero(
        env: dict[str, str], fleet: Fleet, store: Store) -> None:
    (task,) = submit_goals(env, [("graceful", "echo", {"sleep": 1.0})], modules=[MODULE])
    worker = fleet.start()
    held = wait_until(lambda: [t for t in held_by(store, worker.pid)
                               if t["status"] == "running"],
                      30, f"worker pid {worker.pid} to claim the task")
    worker_id = held[0]["lease_owner"]

    rc = fleet.sigterm(worker, timeout=30)

    assert rc == 0, f"worker exited {rc}:\n{worker.log()}"
    assert "signal SIGTERM" in worker.log()
    assert held_by(store, worker.pid) == []  # nothing left leased to a dead process
    row = store.reads.get(task["id"])
    history = events_of(store, task["id"])
    left = [e for e in history if e["worker"] == worker_id and e["from_status"] == "running"]
    assert len(left) == 1, history
    # Within the grace period it finishes the run (no criteria: done at once, in one
    # transition, when it judges; judging otherwise); past it, it hands the task back.
    assert (left[0]["to_status"], row["status"]) in {("judging", "judging"),
                                                     ("judging", "done"),
                                                     ("done", "done"),
                                                     ("pending", "pending")}, history

    # Whatever it left, the next worker completes.
    after = fleet.start("--once")
    assert after.proc.wait(60) == 0, after.log()
    row = store.reads.get(task["id"])
    assert row["status"] == "done" and row["result"]["echo"] == "graceful"
    assert terminal_event_counts(store) == {uuid.UUID(task["id"]): 1}


def test_a_second_sigterm_hands_back_what_is_in_flight_at_once(
        env: dict[str, str], fleet: Fleet, store: Store) -> None:
    # A 60 s stop grace and a task that sleeps 30 s: the first SIGTERM waits for it, the
    # second ends the grace, and the worker hands the task back and exits.
    fleet.env["ORGCHART_WORKER__STOP_GRACE_SECONDS"] = "60"
    (task,) = submit_goals(env, [("slow", "echo", {"sleep": 30.0})], modules=[MODULE])
    worker = fleet.start()
    held = wait_until(lambda: [t for t in held_by(store, worker.pid)
                               if t["status"] == "running"],
                      30, f"worker pid {worker.pid} to claim the task")
    assert fleet.sigterm(worker, timeout=1.0) is None  # within its grace: still working
    rc = fleet.sigterm(worker, timeout=20.0)

    assert rc == 0, f"worker exited {rc}:\n{worker.log()}"
    assert "SIGTERM again: handing back the tasks in flight now" in worker.log()
    assert "handed back 1" in worker.log()
    row = store.reads.get(task["id"])
    assert (row["status"], row["lease_owner"]) == ("pending", None)
    history = events_of(store, task["id"])
    assert history[-1]["worker"] == held[0]["lease_owner"], history
    assert history[-1]["detail"] == "released by a worker shutting down", history
