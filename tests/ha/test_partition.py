"""Partition: one worker host is cut off while it holds leases, then comes back.

Three "hosts" are network namespaces joined to this one by veth pairs on private /30s
the test creates (10.213.N.0/30). Each runs one ``orgchart worker`` that reaches the
formation's PostgreSQL and its own fake Ollama server at the root end of its pair, with
``tcp_user_timeout`` and keepalives lowered (``TCP_USER_TIMEOUT_MS``). Once host 0 holds
leases, both ends of its link go down (no packet passes) for twice the lease, then
the link heals.

Then: the other hosts ran host 0's tasks once its leases expired (within lease + 2 s of
the cut, with a margin for this loaded machine); every write host 0 attempted for those
tasks after the heal was refused by fencing (no event of its for them after they were
reaped; host 0 is stopped, and has exited cleanly, before that is read, so every write
it would make has been tried); every root ends ``done`` with one terminal event per
task; host 0 noticed the partition (``partition_detect_seconds``: the cut to its log
line "database connection lost") within its ``tcp_user_timeout`` plus one heartbeat
interval; and every model call paid twice (counted at the servers) is one host 0 had
begun before the cut and not recorded: its calls in flight (a recorded reply is
replayed, never paid again).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.ha_cluster import Formation, Host
from runtime.audit.history import Recorder
from tests.chaos.helpers import REPO_ROOT, WorkerProc, audited, cli, record_model_server
from tests.fake_ollama import FakeOllama
from tests.ha.support import (
    BENCH_MODULE,
    answered_more_than_once,
    check_history,
    first_log_time,
    paid_twice,
    roots_done,
    rows,
    store_on,
    submit_work,
    wait_for,
    worker_env,
)

pytestmark = [pytest.mark.timeout(600)]

HOSTS = 3
LEASE_SECONDS = 6.0
TCP_USER_TIMEOUT_MS = 3000
#: The server ends host 0's sessions left inside a transaction by the cut this soon (its
#: row locks would otherwise hide its tasks from the reaper): under the lease.
IDLE_IN_TX_MS = 3000
MODEL_DELAY_SECONDS = 1.0
SEED_ROOTS, LEADS, WRITERS = 6, 10, 20
#: Tasks host 0 may hold (a handful: the others must take them all over in the lease).
HOST0_MAX_IN_FLIGHT = 12
#: What the machine's load may add to "within lease + 2 s" (it is shared; see the figure).
TAKEOVER_SLACK_SECONDS = 4.0


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    """Namespaces with veth pairs; removed at the end."""
    made = [Host(f"ocha-{os.getpid()}-{i}", 200 + i) for i in range(HOSTS)]
    try:
        for host in made:
            host.create()
        yield made
    finally:
        for host in made:
            host.heal()
            host.destroy()


def _start_worker(host: Host, env: dict[str, str], log_dir: Path, n: int,
                  *extra: str) -> WorkerProc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"host-{n}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(host.command(cli(
            "worker", "--agents-module", BENCH_MODULE, "--lease-seconds", str(LEASE_SECONDS),
            "--worker-id", f"host{n}", *extra)), env=env, cwd=REPO_ROOT, stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return WorkerProc(n, proc, log_path)


def _env_for(host: Host, formation: Formation, ha_db: str, model: FakeOllama,
             home: Path) -> dict[str, str]:
    url = ha_db.replace("127.0.0.1", host.root_addr)
    return worker_env(dict(os.environ), url, model.url, home,
                      ORGCHART_DATABASE__TCP_USER_TIMEOUT_MS=str(TCP_USER_TIMEOUT_MS),
                      ORGCHART_DATABASE__KEEPALIVES_IDLE_SECONDS="2",
                      ORGCHART_DATABASE__KEEPALIVES_INTERVAL_SECONDS="1",
                      ORGCHART_DATABASE__KEEPALIVES_COUNT="2",
                      ORGCHART_DATABASE__CONNECT_TIMEOUT_SECONDS="3",
                      ORGCHART_DATABASE__IDLE_IN_TRANSACTION_TIMEOUT_MS=str(IDLE_IN_TX_MS))


def _held(store: Any, worker: str) -> list[Any]:
    """Running tasks ``worker`` holds (a judge's lease changes no status: left out)."""
    return [r[0] for r in rows(store, "SELECT id FROM tasks WHERE lease_owner = :w "
                                      "AND lease_token IS NOT NULL AND status = 'running'",
                               w=worker)]


def _stop(worker: WorkerProc, timeout: float = 60.0) -> int | None:
    """SIGTERM ``worker`` and wait for it to exit; its exit status (None: it hung)."""
    worker.proc.send_signal(signal.SIGTERM)
    try:
        return worker.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _late_writes(store: Any, held: list[Any], cut_at: float) -> int:
    """Events host 0 wrote for ``held`` after the cut, other than on a claim of its own.

    A fan-in flip (``waiting -> ready_to_aggregate``) is no late write: a waiting parent
    holds no lease, and the flip is written by whichever worker ends its last child.
    """
    late = []
    events = rows(store, "SELECT task_id, worker, from_status, to_status FROM task_events "
                         "WHERE task_id = ANY(:ids) AND at > to_timestamp(:t) "
                         "ORDER BY id", ids=held, t=cut_at)
    reclaimed: set[Any] = set()
    for task_id, worker, from_status, to_status in events:
        if worker != "host0":
            continue
        if from_status in ("pending", "ready_to_aggregate") and to_status == "running":
            reclaimed.add(task_id)  # a new claim after the heal: a new lease, legitimately
        elif from_status == "waiting" and to_status == "ready_to_aggregate":
            continue  # fan-in: a waiting parent holds no lease; whoever ends its last child
            # (host 0 too, on a child it claimed after the heal) or the sweeper flips it
        elif task_id not in reclaimed:
            late.append((task_id, from_status, to_status))
    if late:
        print(f"host 0's writes recorded after the cut: {late}")
    return len(late)


def _takeover(store: Any, held: list[Any], cut_at: float) -> float | None:
    """Seconds from the cut until the last of ``held`` was claimed by another host."""
    found = rows(store, "SELECT task_id, extract(epoch FROM min(at)) FROM task_events "
                        "WHERE task_id = ANY(:ids) AND to_status IN ('running', 'judging') "
                        "AND worker <> 'host0' AND at > to_timestamp(:t) "
                        "AND from_status IS DISTINCT FROM to_status GROUP BY task_id",
                 ids=held, t=cut_at)
    if len(found) < len(held):
        return None
    return max(float(t) for _, t in found) - cut_at


def test_a_host_cut_off_while_holding_leases_loses_nothing(
        formation: Formation, ha_db: str, hosts: list[Host], figures: dict[str, Any],
        tmp_path: Path) -> None:
    models = [FakeOllama(host=h.root_addr).start() for h in hosts]
    for m in models:
        m.delay_seconds = MODEL_DELAY_SECONDS
    store = store_on(ha_db)
    workers: list[WorkerProc] = []
    try:
        roots = submit_work(store, SEED_ROOTS, LEADS, WRITERS)
        envs = [_env_for(h, formation, ha_db, m, tmp_path / f"home{n}")
                for n, (h, m) in enumerate(zip(hosts, models, strict=True))]
        # Host 0 starts alone, so it holds work when it is cut off; the others join then.
        workers.append(_start_worker(hosts[0], envs[0], tmp_path / "logs", 0,
                                     "--max-in-flight", str(HOST0_MAX_IN_FLIGHT)))
        wait_for(lambda: len(_held(store, "host0")) >= 5, 180, "host 0 to hold leases")
        workers += [_start_worker(hosts[n], envs[n], tmp_path / "logs", n)
                    for n in range(1, HOSTS)]
        in_flight_at_cut = models[0].in_flight
        rec = Recorder(tmp_path / "history.jsonl", process="test")
        hosts[0].cut()
        cut_at = time.time()  # the link is down: nothing host 0 sends arrives after this
        held = _held(store, "host0")  # it can write nothing more from here
        seen_at_cut = set(models[0].seen)
        try:
            took_over = wait_for(lambda: _takeover(store, held, cut_at), 60,
                                 "the other hosts to take over host 0's tasks")
        except AssertionError:
            print(rows(store, "SELECT task_id, worker, from_status, to_status, at FROM "
                              "task_events WHERE task_id = ANY(:ids) AND at > to_timestamp(:t)"
                              " ORDER BY task_id, id", ids=held, t=cut_at))
            raise
        time.sleep(max(0.0, cut_at + 2 * LEASE_SECONDS - time.time()))
        # Every call host 0 began before the cut: what its model server has read by now,
        # before the heal (nothing host 0 sends arrives during the cut). Read at the cut,
        # a request that arrived just before it but was read late by the server's handler
        # thread would be missed; "read_after_cut" below counts such requests (0 in four
        # runs under load on 2026-12-02: not what made this test fail once in CI).
        started_on_host0 = set(models[0].seen)
        hosts[0].heal()
        healed_at = time.time()
        rec.fault("partition", "host0", cut_at, healed_at)
        wait_for(lambda: roots_done(store, roots), 400, "every root to finish", interval=1.0)
        crashed = [] if workers[0].alive() else [0]
        # Host 0 stops: what it still holds gets its stop grace to be written (each write
        # fenced by the lease it lost) and the rest is handed back (fenced too). Once it
        # has exited, every late write it could make after the heal has been tried.
        host0_exit = _stop(workers[0])
        late = _late_writes(store, held, cut_at)
        history = check_history(store, roots)
        twice = paid_twice(models)
        twice_elsewhere = set(answered_more_than_once(models)) - started_on_host0
        for m in models:
            record_model_server(rec, m)
        report = audited(store, rec)
        logs = [w.log(10**8) for w in workers]  # the whole log: the first lines matter
        crashed += [w.number for w in workers[1:] if not w.alive()]
    finally:
        for w in workers:
            if w.alive():
                w.proc.kill()
            w.proc.wait(10)
        store.dispose()
        for m in models:
            m.stop()
    noticed = first_log_time(logs[0], "database connection lost")
    result = {
        "partition_detect_seconds": round(noticed - cut_at, 2) if noticed else None,
        "takeover_seconds": round(took_over, 2), "lease_seconds": LEASE_SECONDS,
        "tcp_user_timeout_ms": TCP_USER_TIMEOUT_MS,
        "idle_in_transaction_timeout_ms": IDLE_IN_TX_MS,
        "cut_seconds": round(healed_at - cut_at, 1),
        "tasks_held_at_cut": len(held), "late_writes_recorded": int(late or 0),
        "late_writes_refused": sum(logs[0].count(f"late {w} ignored")
                                   for w in ("write", "charge", "delegation", "retry")),
        "model_calls_paid_twice": twice, "model_calls_in_flight_at_cut": in_flight_at_cut,
        "model_calls_host0_began_before_cut": len(started_on_host0),
        "model_calls_host0_read_after_cut": len(started_on_host0 - seen_at_cut),
        "tasks": history["tasks"], "hosts": HOSTS,
    }
    figures["partition"] = result
    print(json.dumps({**result, **history}, indent=2, default=str))
    assert not crashed, logs
    assert host0_exit == 0, logs[0][-4000:]
    assert history["roots_not_done"] == {} and history["missing_roots"] == [], history
    assert history["terminal_events_not_once"] == {}, history
    assert history["duplicate_children"] == []
    assert int(late or 0) == 0, "a write of the cut-off host was recorded"
    assert noticed is not None, "\n".join(  # what host 0 said, repeats left out
        dict.fromkeys(line[24:200] for line in logs[0].splitlines()))
    assert noticed - cut_at <= TCP_USER_TIMEOUT_MS / 1000 + LEASE_SECONDS / 3 + 2, result
    assert took_over <= LEASE_SECONDS + 2 + TAKEOVER_SLACK_SECONDS, result
    # Paid twice: only calls host 0 began before the cut and had not recorded (a recorded
    # reply is replayed when the task runs again, not paid): its calls in flight.
    assert twice_elsewhere == set(), result
    assert report.ok, report.text()
