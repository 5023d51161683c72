"""A SIGKILLed worker's tasks come back in about a second, not after its lease (issue 44).

Real ``orgchart worker`` processes on the test database, with a 60 s lease:

- one worker runs the leaves of three trees, another (alive throughout) the parents and
  the judge. The leaf worker is SIGKILLed while it holds every leaf; PostgreSQL ends its
  liveness session, and the live worker's dead-owner pass takes the leaves back long
  before the lease (the test allows 10 s; the figure is printed). A new worker then runs
  them, the trees end ``done``, only the dead worker's deliveries were taken, and
  ``orgchart audit``'s checker finds no violation;
- ``orgchart worker --once`` after a SIGKILL (issue 45, item 5): the dead worker's task,
  its lease expired, is taken back and run, where the command used to exit at once and
  leave it ``running``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from runtime.audit.history import Recorder
from runtime.store.store import Store
from tests.chaos.helpers import (
    REPO_ROOT,
    Fleet,
    WorkerProc,
    assert_audited,
    cli,
    held_by,
    server_now,
)
from tests.factories import submit
from tests.support import wait_until

MODULE = "tests.chaos.agents"
LEASE_SECONDS = 60
ROOTS, LEAVES = 3, 6
#: Long enough that the leaf worker still holds every leaf when it is killed.
LEAF_SLEEP_SECONDS = 3.0
#: Far under the lease: "taken back" must not mean "the lease expired".
TAKEN_BACK_WITHIN_SECONDS = 10.0
SESSION_ENDED = "released: its worker's session ended%"


def _rows(store: Store, sql: str, **params: Any) -> list[Any]:
    with store.engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params).all())


def _holding(store: Store, worker: WorkerProc, n: int) -> list[dict[str, Any]] | None:
    held = [t for t in held_by(store, worker.pid)
            if t["status"] == "running" and t["to_agent"] == "spender"]
    return held if len(held) >= n else None


def test_a_sigkilled_worker_s_leaves_are_taken_back_at_once(
        store: Store, make_fleet: Callable[[list[str]], Fleet], history: Recorder) -> None:
    fleet = make_fleet(["--agents-module", MODULE, "--lease-seconds", str(LEASE_SECONDS)])
    parents = fleet.start("--agents", "spend_fanout,judge")
    leaves = fleet.start("--agents", "spender")
    store.tasks.submit_many("spend_fanout", "task", [
        {"goal": f"dead worker {i}", "n": LEAVES, "sleep": LEAF_SLEEP_SECONDS}
        for i in range(ROOTS)])
    held = wait_until(lambda: _holding(store, leaves, ROOTS * LEAVES), 60.0,
                      "the leaf worker to hold every leaf")

    fleet.sigkill(leaves)
    killed_at = server_now(store)
    wait_until(lambda: not held_by(store, leaves.pid), TAKEN_BACK_WITHIN_SECONDS,
               "the dead worker's leaves taken back")
    (last_back,) = _rows(store, "SELECT max(at) AS at FROM task_events "
                                "WHERE detail LIKE :d", d=SESSION_ENDED)
    print(f"\n  {len(held)} leaves taken back {(last_back.at - killed_at).total_seconds():.2f}"
          f" s after the SIGKILL (lease {LEASE_SECONDS} s)")

    fleet.start("--agents", "spender")
    wait_until(lambda: _all_done(store), 90.0, "every tree done")
    assert parents.alive(), parents.log()
    taken = _rows(store, "SELECT e.task_id, (SELECT c.worker FROM task_events c "
                         "  WHERE c.task_id = e.task_id AND c.id < e.id "
                         "  AND c.to_status = 'running' ORDER BY c.id DESC LIMIT 1) AS holder "
                         "FROM task_events e WHERE e.detail LIKE :d", d=SESSION_ENDED)
    assert {r.task_id for r in taken} == {t["id"] for t in held}
    assert all(f":{leaves.pid}:" in r.holder for r in taken)  # no live worker's delivery
    assert_audited(store, history)


def _all_done(store: Store) -> bool:
    roots = _rows(store, "SELECT status FROM tasks WHERE parent_id IS NULL")
    return len(roots) == ROOTS and all(r.status == "done" for r in roots)


def test_worker_once_after_a_sigkill_runs_the_task_left_behind(
        store: Store, make_fleet: Callable[[list[str]], Fleet], history: Recorder) -> None:
    fleet = make_fleet(["--agents-module", MODULE, "--agents", "spender,judge"])
    victim = fleet.start("--lease-seconds", "1")
    task = submit(store, "spender", {"goal": "left behind", "sleep": 2.0})
    wait_until(lambda: _holding(store, victim, 1), 60.0, "the worker to hold the task")
    fleet.sigkill(victim)
    wait_until(lambda: _expired(store, task["id"]), 10.0, "the dead worker's lease to expire")

    once = subprocess.run(cli("worker", "--agents-module", MODULE, "--agents", "spender,judge",
                              "--once"), env=fleet.env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert once.returncode == 0, once.stderr
    row = store.reads.get(task["id"])
    assert row is not None and row["status"] == "done", (row and row["status"], once.stderr)
    assert_audited(store, history)


def _expired(store: Store, task_id: Any) -> bool:
    (row,) = _rows(store, "SELECT lease_expires_at < now() AS expired, "
                          "lease_expires_at IS NULL AS unleased FROM tasks WHERE id = :i",
                   i=task_id)
    assert not row.unleased, "taken back before the lease expired: nothing left to test"
    return bool(row.expired)
