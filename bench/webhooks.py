"""Webhook delivery latency, and the outbox's cost on the hot path.

**webhook_delivery_ms**: from the commit of a tree's last transition to the receiver's
200. ``trees`` one-task trees (agent ``noop``) are finished by this process, a few at a
time at ``rate`` trees per second (claim, then ``finish_running``: the root ends, its
``tree.finished`` row is written by the outbox trigger in that transaction); the time
``finish_running`` returns is the commit. A deliverer (the loop every worker and
``serve`` runs: LISTEN, claim, sign, POST) sends them to a loopback receiver that
verifies every request with the ``standardwebhooks`` library and stamps its arrival.
Both run in this process, on one clock. Unsigned requests and duplicates are counted.

**Hot path** (``--hot-path``): ``bench.drain``'s trial (``noop`` tasks through the
full lifecycle by one ``orgchart worker --once``) on the same queue size, four cases
interleaved: the outbox trigger disabled; enabled with no endpoint (the cost everyone
pays); an endpoint subscribed to an event that never fires here (``fire.rollup``: the
trigger's join runs, writes nothing); an endpoint subscribed to ``tree.finished``
(every task is a root: one outbox row per task, sent by the worker's own deliverer to
a loopback receiver while it drains).

With ``--hot-path``, first the trigger's own cost: microseconds per ``task_events``
INSERT statement (1 row, 200 rows) with the trigger dropped, disabled, and enabled
with no endpoint, measured inside the server (:func:`measure_trigger_cost`).

**webhook_lost / webhook_unsigned** (``--chaos``): the same trees, sent by deliverer
processes of which one is SIGKILLed every 2 s (and another started), to a receiver that
answers 500 to one request in five and hangs past the sender's timeout on one in
twenty: trees whose event never got a 2xx, requests that failed verification, and the
duplicates (by ``webhook-id``). PostgreSQL is not restarted here (the chaos suite's
servers are its own).

    python -m bench.webhooks [--trees 1000] [--rate 200] [--hot-path --tasks 2000] [--chaos]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench import drain
from bench.common import (
    _scratch_home,
    connect,
    median,
    ms,
    open_store,
    percentile,
    report,
    scratch_database,
    submit_noop,
)
from runtime.config import WebhooksSettings
from runtime.store.rows import RunOutcome
from runtime.store.store import Store
from runtime.store.webhooks import EndpointRow
from runtime.webhooks import Deliverer, DeliveryConfig
from tests.webhook_receiver import SECRET, Receiver

#: Not ORGCHART_*: bench.common.worker_env keeps the rest of the environment.
SECRET_ENV = "BENCH_HOOK_SECRET"
REPO_ROOT = Path(__file__).resolve().parents[1]
BATCH = 5
TIMEOUT_SECONDS = 120.0
POLL_SECONDS = 0.01


def _subscribe(store: Store, url: str, events: tuple[str, ...]) -> None:
    store.webhooks.upsert_endpoints([EndpointRow("bench", url, events, SECRET_ENV)], source="cli")


def _finish_paced(store: Store, trees: int, rate: float) -> dict[str, float]:
    """Finish every root, ``BATCH`` at a time at ``rate`` trees/s; root id -> commit time."""
    committed: dict[str, float] = {}
    started = time.monotonic()
    while len(committed) < trees:
        rows = store.claims.claim(["noop"], BATCH, "bench", 60)
        if not rows:
            break
        # 'failed' ends a root in one statement (no judge): the transition is what counts.
        store.transitions.finish_running([RunOutcome(r.id, r.lease, "failed", error="bench")
                                          for r in rows], "bench")
        now = time.monotonic()
        committed.update({str(r.id): now for r in rows})
        pause = started + len(committed) / rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    return committed


def measure_delivery(url: str, trees: int = 1000, rate: float = 200.0) -> dict[str, Any]:
    """Finish ``trees`` trees and time each one's ``tree.finished`` to the receiver's 200."""
    store, deliver_store = open_store(url, pool_size=4), open_store(url, pool_size=12)
    receiver = Receiver().start()
    deliverer = Deliverer(deliver_store, DeliveryConfig(WebhooksSettings(allow_private=True)),
                          env={SECRET_ENV: SECRET})
    try:
        _subscribe(store, receiver.url, ("tree.finished",))
        submit_noop(store, trees)
        deliverer.start()
        time.sleep(0.2)  # the deliverer is listening
        committed = _finish_paced(store, trees, rate)
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while len({r.data["root_id"] for r in receiver.received}) < len(committed):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(receiver.received)} of {len(committed)} delivered")
            time.sleep(POLL_SECONDS)
    finally:
        deliverer.stop()
        receiver.stop()
        store.dispose()
        deliver_store.dispose()
    first: dict[str, float] = {}
    for got in receiver.received:
        first.setdefault(got.data["root_id"], got.at)
    latencies = [first[root] - at for root, at in committed.items()]
    ids = [r.webhook_id for r in receiver.received]
    return {
        "webhook_delivery_p50_ms": ms(percentile(latencies, 50)),
        "webhook_delivery_p99_ms": ms(percentile(latencies, 99)),
        "webhook_delivery_max_ms": ms(max(latencies)),
        "webhook_trees": len(committed),
        "webhook_rate_per_s": rate,
        "webhook_delivery_duplicates": len(ids) - len(set(ids)),
        "webhook_delivery_unsigned": receiver.unsigned,
    }


ALLOW_PRIVATE = "[webhooks]\nallow_private = true\n"


def _trial_with(url: str, tasks: int, setting: drain.Setting, config: str) -> dict[str, Any]:
    """One drain trial with the workers' configuration file holding ``config``."""
    path = _scratch_home() / "empty.toml"  # the file bench.common's workers read
    path.write_text(config)
    try:
        return drain.trial(url, tasks, setting)
    finally:
        path.write_text("")


def _case(url: str, receiver_url: str, case: str) -> None:
    """Set the database up for ``case``: the trigger on or off, which endpoint."""
    with connect(url) as conn:
        conn.execute("DELETE FROM webhook_endpoints")
        switch = "DISABLE" if case == "no_trigger" else "ENABLE"
        conn.execute(f"ALTER TABLE task_events {switch} TRIGGER task_events_webhook_outbox")
    events = {"subscribed_no_match": ("fire.rollup",),
              "subscribed_every_root": ("tree.finished",)}.get(case)
    if events:
        store = open_store(url, pool_size=1)
        try:
            _subscribe(store, receiver_url, events)
        finally:
            store.dispose()


def measure_hot_path(url: str, tasks: int = 2000, rounds: int = 2) -> dict[str, Any]:
    """The drain with the trigger off, on with no endpoint, a non-matching one, one getting
    every root; ``rounds`` interleaved trials each, the median kept."""
    setting = drain.Setting.parse("1xdefault")
    receiver = Receiver().start()
    os.environ[SECRET_ENV] = SECRET  # the workers inherit it (bench.common.worker_env)
    cases = ("no_trigger", "none", "subscribed_no_match", "subscribed_every_root")
    trials: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    try:
        for _ in range(rounds):
            for case in cases:
                _case(url, receiver.url, case)
                trials[case].append(_trial_with(url, tasks, setting, ALLOW_PRIVATE))
    finally:
        receiver.stop()
    keys = ("tasks_per_s_after_startup", "worker_cpu_ms_per_task", "postgres_cpu_ms_per_task")
    figures: dict[str, Any] = {"tasks": tasks, "rounds": rounds}
    for case, runs in trials.items():
        for key in keys:
            values = [r[key] for r in runs if r[key] is not None]
            figures[f"{case}_{key}"] = round(median(values), 3) if values else None
    figures["delivered_while_draining"] = len(receiver.received)
    return figures


#: One transition's event rows, ``%s`` statements of ``rows`` rows, run inside the server
#: (a DO loop: no client round trip in the figure).
_EVENT_LOOP = """DO $$ BEGIN FOR i IN 1..%s LOOP
    INSERT INTO task_events (task_id, from_status, to_status)
    SELECT gen_random_uuid(), 'pending', 'running' FROM generate_series(1, %s);
END LOOP; END $$"""
_TRIGGER = "task_events_webhook_outbox"


def measure_trigger_cost(url: str, statements: int = 5000, rounds: int = 5) -> dict[str, Any]:
    """Microseconds per ``task_events`` INSERT statement (1 and 200 rows) with the outbox
    trigger dropped, disabled, and enabled with no endpoint: what every transition pays.

    Server-side loops in one transaction per case (rolled back), rounds interleaved,
    the median kept.
    """
    with connect(url) as conn:
        conn.execute("DELETE FROM webhook_endpoints")
        definition = conn.execute("SELECT pg_get_triggerdef(oid) FROM pg_trigger "
                                  "WHERE tgname = %s", (_TRIGGER,)).fetchone()[0]  # type: ignore[index]
        times: dict[str, list[float]] = {}
        for _ in range(rounds):
            for case in ("dropped", "disabled", "no_endpoint"):
                conn.execute(f"DROP TRIGGER IF EXISTS {_TRIGGER} ON task_events")
                if case != "dropped":
                    conn.execute(definition)
                    switch = "DISABLE" if case == "disabled" else "ENABLE"
                    conn.execute(f"ALTER TABLE task_events {switch} TRIGGER {_TRIGGER}")
                for rows in (1, 200):
                    n = statements if rows == 1 else max(1, statements // 50)
                    with conn.transaction(force_rollback=True):
                        started = time.perf_counter()
                        conn.execute(_EVENT_LOOP % (n, rows))  # type: ignore[arg-type]
                        times.setdefault(f"{case}_{rows}", []).append(
                            (time.perf_counter() - started) / n)
        conn.execute(f"DROP TRIGGER IF EXISTS {_TRIGGER} ON task_events")
        conn.execute(definition)
    figures = {f"{key}_row_statement_us": round(median(v) * 1e6, 1) for key, v in times.items()}
    for rows in (1, 200):
        figures[f"no_endpoint_overhead_{rows}_row_us"] = round(
            (median(times[f"no_endpoint_{rows}"]) - median(times[f"dropped_{rows}"])) * 1e6, 1)
    return figures


#: A deliverer process for the chaos run: the loop every worker runs, until it is killed.
_DELIVERER = """
import sys, threading
from runtime.config import WebhooksSettings
from runtime.store.postgres import engines
from runtime.store.store import Store
from runtime.webhooks import Deliverer, DeliveryConfig
store = Store(engines.create_db_engine(sys.argv[1], pool_size=20))
config = DeliveryConfig(WebhooksSettings(
    allow_private=True, timeout_seconds=float(sys.argv[2]), retry_base_seconds=0.05,
    retry_max_seconds=0.5, max_attempts=100))
Deliverer(store, config).start()
threading.Event().wait()
"""


def _spawn_deliverer(url: str, timeout: float) -> subprocess.Popen[bytes]:
    env = {**os.environ, SECRET_ENV: SECRET, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-c", _DELIVERER, url, str(timeout)],
                            cwd=REPO_ROOT, env=env, stderr=subprocess.DEVNULL)


def measure_chaos(url: str, trees: int = 300, deliverers: int = 3, kill_every: float = 2.0,
                  rate: float = 50.0, timeout: float = 1.0) -> dict[str, Any]:
    """Every committed event delivered, signed, while deliverers are SIGKILLed.

    ``deliverers`` processes run the delivery loop; every ``kill_every`` seconds one is
    SIGKILLed and another started. The receiver answers 500 to one request in five and
    hangs past the deliverers' ``timeout`` on one in twenty (then answers 200: the sender
    has given up, the event goes again). ``webhook_lost`` counts committed trees whose
    ``tree.finished`` never got a 2xx; duplicates are counted by ``webhook-id``.
    """
    receiver = Receiver(answer=lambda n: 500 if n % 5 == 0 else 200,
                        hang=lambda n: timeout + 0.5 if n % 20 == 0 else 0.0).start()
    store = open_store(url, pool_size=4)
    procs = [_spawn_deliverer(url, timeout) for _ in range(deliverers)]
    kills = 0
    try:
        _subscribe(store, receiver.url, ("tree.finished",))
        submit_noop(store, trees)
        committed: dict[str, float] = {}
        last_kill = time.monotonic()
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if len(committed) < trees:
                committed.update(_finish_paced(store, min(BATCH, trees - len(committed)), rate))
            elif len({r.data["root_id"] for r in receiver.received}) >= trees:
                break
            else:
                time.sleep(POLL_SECONDS)
            if time.monotonic() - last_kill >= kill_every:
                victim = procs.pop(0)
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                kills += 1
                procs.append(_spawn_deliverer(url, timeout))
                last_kill = time.monotonic()
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        receiver.stop()
        store.dispose()
    delivered = {r.data["root_id"] for r in receiver.received}
    ids = [r.webhook_id for r in receiver.received]
    return {
        "webhook_lost": len(set(committed) - delivered),
        "webhook_unsigned": receiver.unsigned,
        "webhook_duplicates": len(ids) - len(set(ids)),
        "webhook_chaos_trees": len(committed),
        "webhook_chaos_requests": receiver.requests,
        "webhook_chaos_kills": kills,
    }


def main(trees: int = 1000, rate: float = 200.0, hot_path: bool = False, tasks: int = 2000,
         chaos: bool = False, server: str | None = None) -> dict[str, Any]:
    """Run in a scratch database; print and return the figures."""
    with scratch_database(f"webhooks_{uuid.uuid4().hex[:4]}", server) as url:
        if chaos:
            return report(f"webhooks under kills ({trees} trees, a deliverer SIGKILLed every "
                          "2 s, 1 in 5 answered 500, 1 in 20 hung)",
                          measure_chaos(url, trees))
        if hot_path:
            report("outbox trigger, no endpoint (task_events INSERT statements)",
                   measure_trigger_cost(url))
            return report(f"webhooks hot path ({tasks} noop tasks, drain 1xdefault)",
                          measure_hot_path(url, tasks))
        figures = measure_delivery(url, trees, rate)
    return report(f"webhook delivery ({trees} trees at {rate:g}/s, loopback receiver)",
                  figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--hot-path", action="store_true")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--chaos", action="store_true")
    a = parser.parse_args()
    main(a.trees, a.rate, a.hot_path, a.tasks, a.chaos)
