"""Webhooks from the durable outbox (issue 39): written with the change, delivered signed.

Real PostgreSQL and a loopback receiver that verifies every request with the
``standardwebhooks`` library (tests/webhook_receiver.py). The deliverer is driven by
hand (``run_once``) except where a process is killed mid-request.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from runtime.cli.app import app
from runtime.config import WebhooksSettings, expand_webhook_events, load_settings
from runtime.store.rows import RunOutcome
from runtime.store.store import Store
from runtime.store.webhooks import EndpointRow
from runtime.webhooks import Deliverer, DeliveryConfig
from tests.factories import submit
from tests.webhook_receiver import SECRET, Receiver

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV = {"HOOK_SECRET": SECRET}
runner = CliRunner()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def _subscribe(store: Store, url: str, events: tuple[str, ...] = ("tree.finished",),
               name: str = "ops") -> None:
    names = tuple(expand_webhook_events(list(events)))  # globs are expanded before storing
    store.webhooks.upsert_endpoints([EndpointRow(name, url, names, "HOOK_SECRET")], source="cli")


def _deliverer(store: Store, **kw: Any) -> Deliverer:
    own = {k: kw.pop(k) for k in ("threads", "per_endpoint") if k in kw}
    config = DeliveryConfig(WebhooksSettings(
        allow_private=True, timeout_seconds=kw.pop("timeout", 2.0), retry_base_seconds=0.01,
        retry_max_seconds=0.02, **kw), **own)
    return Deliverer(store, config, env=ENV)


def _finish(store: Store, root: dict[str, Any], status: str = "failed") -> None:
    row = store.claims.claim([root["to_agent"]], 1, "w", 30)[0]
    store.transitions.finish_running([RunOutcome(row.id, row.lease, status, error="boom")], "w")


def _outbox(store: Store) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT * FROM webhook_outbox ORDER BY id")).mappings()
        return [dict(r) for r in rows]


def _until(check: Callable[[], bool], seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_no_endpoint_means_no_outbox_row(store: Store) -> None:
    _finish(store, submit(store))
    assert _outbox(store) == []


def test_a_committed_finish_is_delivered_signed_with_its_result(store: Store,
                                                               receiver: Receiver) -> None:
    _subscribe(store, receiver.url)
    root = submit(store)
    _finish(store, root)
    attempts = _deliverer(store).run_once()
    assert [a.outcome for a in attempts] == ["delivered"]
    [got] = receiver.received
    assert got.event == "tree.finished" and receiver.unsigned == 0
    assert got.data["root_id"] == str(root["id"]) and got.data["status"] == "failed"
    assert got.data["error"] == "boom" and "spent_usd" in got.data
    assert got.data["url"].endswith(f"/ui/trees/{root['id']}")
    assert got.webhook_id == f"msg_{_outbox(store)[0]['message_id'].hex}"
    assert _outbox(store)[0]["status"] == "delivered"


def test_a_rolled_back_change_sends_nothing(store: Store, receiver: Receiver) -> None:
    _subscribe(store, receiver.url)
    root = submit(store)
    with store.engine.connect() as conn:  # a transition's statement, then a rollback
        trans = conn.begin()
        conn.execute(sa.text("UPDATE tasks SET status = 'failed' WHERE id = :id"),
                     {"id": root["id"]})
        conn.execute(sa.text("INSERT INTO task_events (task_id, from_status, to_status) "
                             "VALUES (:id, 'pending', 'failed')"), {"id": root["id"]})
        inside = conn.execute(sa.text("SELECT count(*) FROM webhook_outbox")).scalar()
        trans.rollback()
    assert inside == 1  # the trigger wrote it in the change's transaction...
    assert _outbox(store) == []  # ... and it went with the rollback
    assert _deliverer(store).run_once() == [] and receiver.requests == 0


def test_a_question_carries_its_schema_and_the_answer_command(store: Store,
                                                             receiver: Receiver) -> None:
    _subscribe(store, receiver.url, ("task.*",))
    question = {"question": "Ship it?", "answer_schema": {"type": "boolean"}}
    task = submit(store, "human", question)
    _deliverer(store).run_once()
    [got] = receiver.received
    assert got.event == "task.question" and got.data["question"] == "Ship it?"
    assert got.data["answer_schema"] == {"type": "boolean"}
    assert got.data["answer"]["command"].startswith(f"orgchart answer {task['id']} --json ")
    assert got.data["answer"]["url"].endswith(f"/tasks/{task['id']}/answer")


def test_a_failing_receiver_is_retried_with_backoff_then_dead_lettered(store: Store) -> None:
    receiver = Receiver(answer=lambda n: 500, body="x" * 5000).start()
    try:
        _subscribe(store, receiver.url)
        _finish(store, submit(store))
        deliverer = _deliverer(store, max_attempts=3)
        outcomes: list[str] = []

        def attempt() -> bool:
            outcomes.extend(a.outcome for a in deliverer.run_once())
            return "dead" in outcomes

        _until(attempt)
        assert outcomes == ["retry", "retry", "dead"]
        [row] = _outbox(store)
        assert row["status"] == "dead" and row["attempts"] == 3 and row["last_status"] == 500
        assert len(row["last_response"].encode()) <= 1024
        assert receiver.requests == 3 and receiver.unsigned == 0
    finally:
        receiver.stop()


def test_backoff_waits_before_the_next_attempt(store: Store) -> None:
    receiver = Receiver(answer=lambda n: 500).start()
    try:
        _subscribe(store, receiver.url)
        _finish(store, submit(store))
        config = DeliveryConfig(WebhooksSettings(allow_private=True, retry_base_seconds=60))
        deliverer = Deliverer(store, config, env=ENV)
        assert [a.outcome for a in deliverer.run_once()] == ["retry"]
        assert deliverer.run_once() == []  # not due for 30-60 s
        [row] = _outbox(store)
        assert row["next_attempt_at"] > row["created_at"]
    finally:
        receiver.stop()


def test_events_of_one_tree_go_out_in_commit_order(store: Store, receiver: Receiver) -> None:
    _subscribe(store, receiver.url, ("task.*", "tree.*"))
    roots = [submit(store, "human", {"question": f"q{i}"}) for i in range(2)]
    for root in roots:
        store.steering.cancel(root["id"])  # task.cancelled, then tree.finished
    deliverer = _deliverer(store)
    first = deliverer.run_once()
    # One event per tree at a time: the question of each first. A delivery that ends
    # within the pass frees its tree's next event for the same pass (on a loaded machine
    # the pass's second claim comes after it), so the pass sends 2 or more; the order
    # each tree's receiver saw is the promise.
    assert len(first) >= 2
    while deliverer.run_once():
        pass
    for root in roots:
        mine = [r.event for r in receiver.received if r.data["root_id"] == str(root["id"])]
        assert mine == ["task.question", "task.cancelled", "tree.finished"]


def test_a_slow_receiver_does_not_hold_back_another(store: Store, receiver: Receiver) -> None:
    slow = Receiver(hang=lambda n: 1.0).start()
    try:
        _subscribe(store, slow.url, name="slow")
        _subscribe(store, receiver.url, name="fast")
        for _ in range(6):
            _finish(store, submit(store))
        deliverer = _deliverer(store, threads=6, per_endpoint=2).start()
        _until(lambda: len(receiver.received) == 6, 5.0)
        assert len(slow.received) < 6  # the fast one finished while the slow one still runs
        deliverer.stop()
    finally:
        slow.stop()


_KILLED_DELIVERER = """
import sys
from runtime.store.postgres import engines
from runtime.store.store import Store
from runtime.config import WebhooksSettings
from runtime.webhooks import Deliverer, DeliveryConfig
store = Store(engines.create_db_engine(sys.argv[1], pool_size=2))
config = DeliveryConfig(WebhooksSettings(allow_private=True, timeout_seconds=30))
Deliverer(store, config, env={"HOOK_SECRET": sys.argv[2]}).run_once()
"""


def test_a_deliverer_killed_mid_request_leads_to_a_redelivery_with_the_same_id(
        store: Store, db_url: str) -> None:
    receiver = Receiver(hang=lambda n: 30.0 if n == 1 else 0.0).start()
    try:
        _subscribe(store, receiver.url)
        _finish(store, submit(store))
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_DELIVERER, db_url, SECRET],
                                cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        try:
            _until(lambda: receiver.requests == 1)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait(10)
        [row] = _outbox(store)
        assert row["status"] == "pending" and row["lease_token"] is not None
        with store.engine.begin() as conn:  # the lease runs out (35 s in real time)
            conn.execute(sa.text("UPDATE webhook_outbox SET lease_expires_at = now() "
                                 "- interval '1 second'"))
        assert [a.outcome for a in _deliverer(store).run_once()] == ["delivered"]
        [got] = receiver.received
        assert got.webhook_id == f"msg_{row['message_id'].hex}"
        assert _outbox(store)[0]["attempts"] == 2
    finally:
        receiver.stop()


def test_a_fire_rollup_is_an_event(store: Store, receiver: Receiver) -> None:
    _subscribe(store, receiver.url, ("fire.rollup",))
    fire_id = store.fires.started({"plan": []})
    store.fires.finished(fire_id, {"plan": []}, {"spawned": 0}, "all quiet")
    _deliverer(store).run_once()
    [got] = receiver.received
    assert got.event == "fire.rollup" and got.data["rollup"] == "all quiet"


# ---------------------------------------------------------------- the CLI
def test_cli_add_list_test_deliveries_redeliver(orgchart_env: dict[str, str], store: Store,
                                                receiver: Receiver,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORGCHART_WEBHOOKS__ALLOW_PRIVATE", "true")
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    add = runner.invoke(app, ["webhooks", "add", "ops", "--url", receiver.url,
                              "--events", "tree.*,task.question", "--secret-env", "HOOK_SECRET"])
    assert add.exit_code == 0, add.output
    listed = runner.invoke(app, ["webhooks", "list", "--json"])
    assert '"tree.finished"' in listed.output and '"task.question"' in listed.output
    sent = runner.invoke(app, ["webhooks", "test", "ops"])
    assert sent.exit_code == 0 and "delivered (HTTP 200)" in sent.output, sent.output
    assert [r.event for r in receiver.received] == ["webhook.test"]
    rows = runner.invoke(app, ["webhooks", "deliveries", "--json"])
    outbox_id = _outbox(store)[0]["id"]
    assert f'"id": {outbox_id}' in rows.output
    again = runner.invoke(app, ["webhooks", "redeliver", str(outbox_id)])
    assert again.exit_code == 0 and "queued again" in again.output
    runner.invoke(app, ["webhooks", "test", "ops"])
    ids = [r.webhook_id for r in receiver.received]
    assert ids[0] == ids[1]  # the redelivery carries the same webhook-id


@pytest.mark.parametrize(("args", "says"), [
    (["--url", "http://93.184.216.34/x", "--events", "tree.finishd"],
     "did you mean 'tree.finished'"),
    (["--url", "http://10.1.2.3/x", "--events", "tree.finished"], "private address"),
    (["--url", "http://localhost:9/x", "--events", "tree.finished"], "private address"),
    (["--url", "ftp://example.com/x", "--events", "tree.finished"], "only http and https"),
])
def test_cli_bad_input_exits_2_and_stores_nothing(orgchart_env: dict[str, str], store: Store,
                                                  args: list[str], says: str) -> None:
    result = runner.invoke(app, ["webhooks", "add", "ops", *args, "--secret-env", "S"])
    assert result.exit_code == 2, result.output
    assert says in result.output
    assert store.webhooks.endpoints() == []


def test_configured_endpoints_are_stored_at_start_and_checked(tmp_path: Path,
                                                             store: Store) -> None:
    from runtime.webhooks import sync_configured

    config = tmp_path / "orgchart.toml"
    config.write_text('[webhooks]\nallow_private = true\n[webhooks.ops]\n'
                      'url = "http://127.0.0.1:9/x"\nevents = ["task.*"]\n'
                      'secret_env = "HOOK_SECRET"\n')
    sync_configured(store, load_settings(config, env={}))
    [row] = store.webhooks.endpoints()
    assert row["name"] == "ops" and row["source"] == "config" and len(row["events"]) == 4
    config.write_text("")
    assert sync_configured(store, load_settings(config, env={})) == ["ops"]
    assert store.webhooks.endpoints() == []
    _ = uuid  # ids are compared as strings above


# ---------------------------------------------------------------- the API
def test_api_add_list_test_deliveries_redeliver(store: Store, receiver: Receiver,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from runtime.http.api import create_app

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*httpx2")
        from fastapi.testclient import TestClient
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    settings = load_settings(None, env={"ORGCHART_WEBHOOKS__ALLOW_PRIVATE": "true",
                                        "ORGCHART_CONFIG": os.devnull})
    client = TestClient(create_app(store=store, settings=settings, api_token=""))
    bad = client.post("/webhooks", json={"name": "ops", "url": receiver.url,
                                         "events": ["tree.finishd"], "secret_env": "HOOK_SECRET"})
    assert bad.status_code == 422 and "did you mean" in bad.text
    assert client.get("/webhooks").json() == []
    made = client.post("/webhooks", json={"name": "ops", "url": receiver.url,
                                          "events": ["tree.*"], "secret_env": "HOOK_SECRET"})
    assert made.status_code == 201 and made.json()["events"] == ["tree.finished"]
    sent = client.post("/webhooks/ops/test").json()
    assert sent["status"] == "delivered" and sent["last_status"] == 200
    assert client.post("/webhooks/nope/test").status_code == 404
    [row] = client.get("/webhooks/deliveries").json()
    assert row["event"] == "webhook.test"
    again = client.post(f"/webhooks/deliveries/{row['id']}/redeliver")
    assert again.status_code == 200 and again.json()["status"] == "pending"
    assert client.post("/webhooks/deliveries/999999/redeliver").status_code == 404
    for body in ({"name": "a\x00b", "url": receiver.url, "events": ["tree.*"], "secret_env": "S"},
                 {"name": "x", "url": "http://a\x00b/", "events": ["tree.*"], "secret_env": "S"},
                 {"name": "x", "url": "http://[::1/", "events": ["tree.*"], "secret_env": "S"},
                 {"name": "x", "url": receiver.url, "events": ["\x00"], "secret_env": "S"},
                 {"name": "x", "url": receiver.url, "events": [], "secret_env": "S"}):
        assert client.post("/webhooks", json=body).status_code == 422, body
    assert client.post("/webhooks/deliveries/99999999999999999999/redeliver").status_code == 422
    assert client.get("/webhooks/deliveries", params={"endpoint": "a\x00"}).status_code == 422


def test_doctor_reports_dead_letters_and_a_backlog_past_alert_after(store: Store) -> None:
    from runtime.fleet.doctor import DoctorLimits, check

    _subscribe(store, "http://127.0.0.1:9/x")
    limits = DoctorLimits(8 * 3600, 24 * 3600, webhook_alert_after_seconds=60)
    assert check(store, limits).webhook_dead == 0
    with store.engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO webhook_outbox (endpoint, event, payload, status, created_at) VALUES "
            "('ops', 'tree.finished', '{}', 'dead', now()), "
            "('ops', 'tree.finished', '{}', 'pending', now() - interval '10 minutes')"))
    checkup = check(store, limits)
    assert checkup.webhook_dead == 1 and checkup.webhook_backlog == 1
    assert any("dead-lettered" in p for p in checkup.problems)
    assert any("waiting longer than" in p for p in checkup.problems)


def test_bench_webhooks_at_a_toy_size(server_url: str) -> None:
    from bench import webhooks as bench_webhooks

    figures = bench_webhooks.main(trees=20, rate=200, server=server_url)
    assert figures["webhook_trees"] == 20
    assert figures["webhook_delivery_unsigned"] == 0
    for key in ("webhook_delivery_p50_ms", "webhook_delivery_p99_ms"):
        assert figures[key] >= 0  # figures are printed, never asserted on


def test_a_worker_process_stores_its_configured_endpoint_and_delivers(
        orgchart_env: dict[str, str], store: Store, receiver: Receiver, tmp_path: Path) -> None:
    config = tmp_path / "hooks.toml"
    config.write_text(f'[webhooks]\nallow_private = true\n[webhooks.ops]\nurl = "{receiver.url}"\n'
                      'events = ["tree.finished"]\nsecret_env = "HOOK_SECRET"\n')
    root = submit(store, "echo", {"goal": "say hi"})
    env = {**orgchart_env, "ORGCHART_CONFIG": str(config), "HOOK_SECRET": SECRET,
           "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "worker", "--agents",
                             "echo,judge", "--agents-module", "tests.support_agents"],
                            cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE)
    try:
        _until(lambda: bool(receiver.received) or proc.poll() is not None, 60.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert receiver.received, stderr.decode()[-2000:]
    [got] = receiver.received
    assert got.event == "tree.finished" and got.data["root_id"] == str(root["id"])
    assert got.data["status"] == store.reads.get(root["id"])["status"]
    assert [e["name"] for e in store.webhooks.endpoints()] == ["ops"]


def test_every_committed_event_arrives_signed_while_deliverers_are_killed(db_url: str) -> None:
    from bench import webhooks as bench_webhooks

    figures = bench_webhooks.measure_chaos(db_url, trees=30, deliverers=2, kill_every=1.0)
    assert figures["webhook_chaos_trees"] == 30 and figures["webhook_chaos_kills"] >= 1
    assert figures["webhook_lost"] == 0 and figures["webhook_unsigned"] == 0


def test_prune_takes_a_trees_delivered_events_and_leaves_the_rest(store: Store,
                                                                  receiver: Receiver) -> None:
    import datetime as dt

    _subscribe(store, receiver.url, ("tree.finished", "fire.rollup"))
    old, failing = submit(store), submit(store)
    _finish(store, old)
    _finish(store, failing)
    store.fires.finished(store.fires.started({}), {}, {}, "note")
    _deliverer(store).run_once()
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE webhook_outbox SET status = 'dead' WHERE root_id = :r"),
                     {"r": failing["id"]})
    assert store.reads.prune(dt.timedelta(seconds=-60)) == (2, 2)
    assert [(r["root_id"], r["status"]) for r in _outbox(store)] == [(failing["id"], "dead")]
