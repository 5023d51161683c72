"""Failover: the primary is SIGKILLed in the middle of a run, and nothing is lost.

Three ``orgchart worker`` processes on the formation's multi-host URL
(``postgresql://postgres@h:p1,h:p2/db?target_session_attrs=read-write``) drain
``SEED_ROOTS`` roots of the seed's org (ceo, directors, scouts, judge) and one tree of
``bench.agents`` (a planner, ``LEADS`` leads, ``WRITERS`` writers: 931 tasks), every model
call answered by a fake Ollama server on loopback that counts what it answered. Once
``KILL_AFTER_DONE`` tasks are done, the primary's ``pg_autoctl`` process tree and its
postmaster are SIGKILLed (its host is lost); ``orgchart submit`` processes are started at
that moment. pg_auto_failover promotes the synchronous standby.

Then: every root (those submitted before, and every one a ``submit`` acknowledged) ends
``done``; no task has more or fewer than one terminal event; no parent has a child twice;
each ``submit`` either printed a root that exists or exited 1 with one line; the workers
listen again on the new primary; and no model call was paid twice beyond the calls in
flight at the kill. ``failover_recovery_seconds`` (the kill to the first task completed
on the new primary) goes to the figures with the monitor's settings.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from bench.ha_cluster import Formation
from runtime.audit.history import Recorder
from runtime.store.notify import StandbyServer, TaskChannel
from tests.chaos.helpers import REPO_ROOT, Fleet, audited, cli, record_model_server
from tests.fake_ollama import FakeOllama
from tests.ha.support import (
    BENCH_MODULE,
    check_history,
    paid_twice,
    roots_done,
    scalar,
    seed_goal,
    store_on,
    submit_work,
    wait_for,
    worker_env,
)

pytestmark = [pytest.mark.timeout(900)]

SEED_ROOTS = 40
LEADS, WRITERS = 30, 30
WORKERS = 3
LEASE_SECONDS = 15
MODEL_DELAY_SECONDS = 0.2
KILL_AFTER_DONE = 300
SUBMITS_AT_THE_KILL = 4


def _standby_refuses_a_listener(formation: Formation, url: str) -> None:
    standby = next(p for p in formation.node_ports if p != formation.primary_port())
    direct = url.replace(url.split("@", 1)[1].split("/", 1)[0], f"127.0.0.1:{standby}")
    with pytest.raises(StandbyServer):
        TaskChannel(direct.split("?", 1)[0]).close()


def _submits(env: dict[str, str], rec: Recorder) -> list[tuple[int, subprocess.Popen[str]]]:
    """Start the submits, each an operation of the history (completed by _acknowledged)."""
    return [(rec.invoke("submit", {"goal": seed_goal(1000 + i)}, f"submit-{i}"),
             subprocess.Popen(cli("submit", seed_goal(1000 + i), "--json"), env=env,
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True))
            for i in range(SUBMITS_AT_THE_KILL)]


def _acknowledged(procs: list[tuple[int, subprocess.Popen[str]]],
                  rec: Recorder) -> tuple[list[uuid.UUID], list[str]]:
    """Roots the submits printed, and what the ones that gave up said (as the history's
    ``ok``, and ``info``: a submit that gave up on the database may have committed)."""
    acked, refused = [], []
    for index, proc in procs:
        out, err = proc.communicate(timeout=180)
        if proc.returncode == 0:
            acked.append(uuid.UUID(json.loads(out)["id"]))
            rec.complete(index, "ok", {"id": str(acked[-1])}, "submit")
            continue
        rec.complete(index, "info", {"error": err.strip()[-300:]}, "submit")
        lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and len(lines) == 1, err
        assert "database" in lines[0] or "cannot reach" in lines[0], err
        refused.append(lines[0])
    return acked, refused


def test_the_primary_dies_mid_run_and_nothing_is_lost(
        formation: Formation, ha_db: str, figures: dict[str, Any], tmp_path: Path) -> None:
    fake = FakeOllama().start()
    fake.delay_seconds = MODEL_DELAY_SECONDS
    store = store_on(ha_db)
    rec = Recorder(tmp_path / "history.jsonl", process="test")
    fleet = Fleet(worker_env(dict(os.environ), ha_db, fake.url, tmp_path / "home"),
                  tmp_path / "workers",
                  ["--agents-module", BENCH_MODULE, "--lease-seconds", str(LEASE_SECONDS)],
                  rec)
    try:
        _standby_refuses_a_listener(formation, ha_db)
        roots = submit_work(store, SEED_ROOTS, LEADS, WRITERS)
        for _ in range(WORKERS):
            fleet.start()
        wait_for(lambda: scalar(store, "SELECT count(*) FROM tasks WHERE status = 'done'")
                 >= KILL_AFTER_DONE, 300, f"{KILL_AFTER_DONE} tasks done")
        in_flight_at_kill = fake.in_flight
        old_port = formation.primary_port()
        _, killed_at = formation.kill_primary()
        submits = _submits(fleet.env, rec)
        new_port = formation.wait_failover(old_port)
        promoted = time.time() - killed_at
        rec.fault("kill", f"primary on port {old_port}", killed_at, time.time())
        first_done = wait_for(lambda: scalar(
            store, "SELECT extract(epoch FROM min(at)) FROM task_events "
                   "WHERE to_status = 'done' AND at > to_timestamp(:t)", t=killed_at),
            120, "a task completed on the new primary")
        acked, refused = _acknowledged(submits, rec)
        wait_for(lambda: roots_done(store, roots + acked), 400, "every root to finish",
                 interval=1.0)
        listening = wait_for(lambda: scalar(
            store, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                   " AND pid <> pg_backend_pid() AND query ILIKE '%LISTEN %'") >= WORKERS,
            30, "the workers to listen on the new primary")
        history = check_history(store, roots + acked)
        twice = paid_twice([fake])
        record_model_server(rec, fake)
        report = audited(store, rec)
        crashed = [w for w in fleet.workers if not w.alive()]
        logs = {w.number: w.log(3000) for w in fleet.workers}
    finally:
        fleet.close()
        store.dispose()
        fake.stop()
    result = {
        "failover_recovery_seconds": round(float(first_done) - killed_at, 2),
        "failover_promoted_seconds": round(promoted, 2), "old_port": old_port,
        "new_port": new_port, "tasks": history["tasks"], "roots": len(roots),
        "submits_acknowledged": len(acked), "submits_refused": refused,
        "model_calls_answered": fake.chats, "model_calls_paid_twice": twice,
        "model_calls_in_flight_at_kill": in_flight_at_kill,
        "workers": WORKERS, "lease_seconds": LEASE_SECONDS,
        "tree": f"{SEED_ROOTS} seed roots + a {1 + LEADS + LEADS * WRITERS}-task tree",
    }
    figures["failover"] = result
    print(json.dumps({**result, **history}, indent=2, default=str))
    assert not crashed, logs
    assert listening
    assert history["missing_roots"] == [] and history["roots_not_done"] == {}, history
    assert history["terminal_events_not_once"] == {}, history
    assert history["duplicate_children"] == []
    assert twice <= in_flight_at_kill, result
    assert report.ok, report.text()
