"""OpenTelemetry traces: decoded by a loopback OTLP/HTTP receiver, and no import when off."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from runtime.store.store import Store
from runtime.telemetry import traces
from tests.timed_tree import build_timed_tree


class Receiver(http.server.BaseHTTPRequestHandler):
    spans: list[Any]
    paths: list[str]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for rs in request.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    self.spans.append((service, span))
        self.paths.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[Receiver]]:
    handler = type("H", (Receiver,), {"spans": [], "paths": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    yield handler
    server.shutdown()
    server.server_close()


def attrs(span: Any) -> dict[str, Any]:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value"))
    return out


def test_a_tree_is_one_trace_with_a_span_per_task_and_model_call(
        receiver: type[Receiver], store: Store) -> None:
    tree = build_timed_tree(store, leads=3, writers=4)
    other = build_timed_tree(store, leads=1, writers=1, seed=3)
    store.reads.export_cursor(traces.CURSOR_NAME)  # created at the newest event...
    with store.database.transaction() as conn:  # ...moved back to export everything written so far
        conn.execute(sa.text("UPDATE export_cursors SET last_event_id = 0"))
    export = traces.TraceExport(store, interval=60)
    sent = export.run_pass(settle=0.0)
    export.stop(flush=False)
    tasks = 1 + 3 + 3 * 4
    assert sent == tasks + tree.calls + 3 + other.calls
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    by_trace: dict[bytes, list[Any]] = {}
    for _, span in receiver.spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    assert set(by_trace) == {tree.root.bytes, other.root.bytes}
    spans = by_trace[tree.root.bytes]
    assert all(service["service.name"] == "orgchart" for service, _ in receiver.spans)
    task_spans = [s for s in spans if "orgchart.task_id" in attrs(s)]
    call_spans = [s for s in spans if "gen_ai.operation.name" in attrs(s)]
    assert len(task_spans) == tasks and len(call_spans) == tree.calls == tasks
    assert len({s.span_id for s in spans}) == len(spans)
    by_task = {uuid.UUID(attrs(s)["orgchart.task_id"]): s for s in task_spans}
    assert set(by_task) == set(tree.parents)
    for task_id, span in by_task.items():
        parent = tree.parents[task_id]
        assert span.span_id == traces.span_id_for(task_id).to_bytes(8, "big")
        assert span.parent_span_id == (b"" if parent is None else by_task[parent].span_id)
        a = attrs(span)
        assert span.name == a["orgchart.agent"]
        assert a["orgchart.status"] == "done" and a["orgchart.verdict.passed"] is True
        assert a["orgchart.deliveries"] == 1 and a["orgchart.spent_tokens"] == 120
        names = [e.name for e in span.events]
        assert names[0] == "pending" and names[-1] == "done" and "running" in names
        assert span.events[0].time_unix_nano == span.start_time_unix_nano
        assert span.end_time_unix_nano == span.events[-1].time_unix_nano
    for span in call_spans:
        a = attrs(span)
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.system"] == "ollama"
        assert a["gen_ai.request.model"] == "qwen3:0.6b"
        assert a["gen_ai.usage.input_tokens"] == 100 and a["gen_ai.usage.output_tokens"] == 20
        assert a["orgchart.route"] == "local" and a["orgchart.cost_usd"] == pytest.approx(0.0012)
        assert span.parent_span_id in {s.span_id for s in task_spans}
        assert span.end_time_unix_nano > span.start_time_unix_nano
        assert span.name == "chat qwen3:0.6b"


def test_the_exporter_follows_new_endings_once(receiver: type[Receiver], store: Store) -> None:
    export = traces.TraceExport(store, interval=60)
    assert export.run_pass(settle=0.0) == 0  # starts at the newest event: nothing old
    tree = build_timed_tree(store, leads=1, writers=2)
    assert export.run_pass(settle=0.0) == 4 + tree.calls
    assert export.run_pass(settle=0.0) == 0  # nothing is sent twice
    second = traces.TraceExport(store, interval=60)
    assert second.run_pass(settle=0.0) == 0  # another process waits: one exporter at a time
    export.stop(flush=False)
    assert len(receiver.spans) == 4 + tree.calls


def test_a_tree_that_ends_while_no_exporter_runs_is_sent_by_the_next_one(
        receiver: type[Receiver], store: Store) -> None:
    first = traces.TraceExport(store, interval=60)
    assert first.run_pass(settle=0.0) == 0
    first.stop(flush=False)  # the exporting process goes away (a crash loses the same)
    tree = build_timed_tree(store, leads=1, writers=2)
    assert receiver.spans == []
    restarted = traces.TraceExport(store, interval=60)
    assert restarted.run_pass(settle=0.0) == 4 + tree.calls  # from the recorded cursor
    assert restarted.run_pass(settle=0.0) == 0
    restarted.stop(flush=False)
    assert {span.trace_id for _, span in receiver.spans} == {tree.root.bytes}


def test_nothing_from_opentelemetry_is_imported_when_no_endpoint_is_set() -> None:
    # The worker and the CLI only (FastAPI itself imports opentelemetry's API when it is
    # installed, so ``orgchart serve`` cannot be checked so).
    code = (
        "import os, sys\n"
        "for k in list(os.environ):\n"
        "    if k.startswith('OTEL_'): del os.environ[k]\n"
        "import runtime.cli.app, runtime.wiring, runtime.engine.worker\n"
        "import runtime.telemetry.traces as t\n"
        "assert t.start_trace_export(None) is None\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('opentelemetry', 'prometheus')))\n"
        "print(bad)\n"
        "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stdout.strip() == "[]"


def test_otlp_configured_reads_the_standard_variables() -> None:
    assert not traces.otlp_configured({})
    assert traces.otlp_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"})
    assert traces.otlp_configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x/v1/traces"})
    assert not traces.otlp_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
                                       "OTEL_SDK_DISABLED": "true"})
    assert not traces.otlp_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
                                       "OTEL_TRACES_EXPORTER": "none"})


def test_a_tree_run_by_a_real_worker_exports_as_one_trace(receiver: type[Receiver],
                                                          db_url: str, store: Store,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.config import load_settings
    from runtime.wiring import build_root, build_runtime

    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "offline"})
    runtime = build_runtime(settings, ["tests.support_agents"], store=store)
    new = build_root(runtime.registry, settings, goal="g", agent="fanout",
                     payload={"n": 2, "child": "fanout"})
    root = runtime.store.tasks.submit(new, actor="test")[0]["id"]
    worker = runtime.worker(None, maintenance=False, listen=False)  # starts the exporter
    try:
        for _ in range(60):
            if worker.run_once() == 0 and runtime.store.hygiene.sweep().ready == 0:
                break
        assert runtime.store.reads.get(root)["status"] == "done"
    finally:
        traces.stop_trace_export()  # flushes what ended
    ids = set(runtime.store.reads.tree_ids(root))
    assert len(ids) == 1 + 2 + 6
    spans = [s for _, s in receiver.spans if s.trace_id == root.bytes]
    task_spans = {uuid.UUID(attrs(s)["orgchart.task_id"]): s for s in spans
                  if "orgchart.task_id" in attrs(s)}
    assert set(task_spans) == ids and len(spans) == len(ids) + sum(
        len(runtime.store.reads.model_calls(i)) for i in ids)
    for task_id, span in task_spans.items():
        parent = runtime.store.reads.get(task_id)["parent_id"]
        expected = b"" if parent is None else traces.span_id_for(parent).to_bytes(8, "big")
        assert span.parent_span_id == expected
        assert [e.name for e in span.events][-1] == "done"


def test_an_exporter_that_cannot_start_never_stops_the_worker() -> None:
    from runtime.store.postgres.engines import create_db_engine

    down = Store(create_db_engine("postgresql://nobody@127.0.0.1:1/none", pool_size=1))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    try:
        assert traces.start_trace_export(down, env=env) is None  # a real unreachable server
        assert traces.running_trace_export() is None
    finally:
        down.dispose()


def test_orgchart_run_delivers_its_trees_spans_before_it_exits(
        receiver: type[Receiver], orgchart_env: dict[str, str]) -> None:
    """A short-lived command: the run is over before the exporter's first timed pass."""
    import json
    import os

    from tests.integration.test_run_acceptance import GOAL, nodes, orgchart

    env = {**orgchart_env, "OTEL_EXPORTER_OTLP_ENDPOINT": os.environ[
        "OTEL_EXPORTER_OTLP_ENDPOINT"]}
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    res = orgchart(env, "run", GOAL, "--json")
    assert res.returncode == 0, res.stderr
    tree = json.loads(res.stdout)
    root = uuid.UUID(tree["id"])
    ids = {uuid.UUID(n["id"]) for n in nodes(tree)}
    assert len(ids) == 5
    task_spans = [s for _, s in receiver.spans if "orgchart.task_id" in attrs(s)]
    assert sorted(uuid.UUID(attrs(s)["orgchart.task_id"]) for s in task_spans) == sorted(ids)
    assert {s.trace_id for s in task_spans} == {root.bytes}
    assert "Traceback" not in res.stderr, res.stderr


def test_the_first_exporter_sends_the_tree_that_is_ending_as_it_starts(
        receiver: type[Receiver], store: Store) -> None:
    """A child ended before the database's first exporter started; its root had not."""
    from decimal import Decimal

    from runtime.store.rows import ChildRow, NewTask, RunOutcome

    done = {"passed": True, "reason": "test"}
    old = build_timed_tree(store, leads=1, writers=1)  # finished history: not sent
    root = store.tasks.submit(NewTask(to_agent="boss", type="task", payload={}))[0]["id"]
    [parent] = store.claims.claim(["boss"], 1, "w1", 60)
    store.transitions.delegate(root, parent.lease_token, [ChildRow(
        to_agent="helper", type="task", payload={}, key="k", budget_tokens=10,
        budget_seconds=10, budget_usd=Decimal("0.1"))], "w1")
    [child] = store.claims.claim(["helper"], 1, "w1", 60)
    store.transitions.finish_running([RunOutcome(child.id, child.lease_token, "done", result={},
                                                 verdict=done)], "w1")
    export = traces.TraceExport(store, interval=60)  # the first: creates the cursor
    [again] = store.claims.claim(["boss"], 1, "w1", 60)  # the aggregate
    store.transitions.finish_running([RunOutcome(root, again.lease_token, "done", result={},
                                                 verdict=done)], "w1")
    assert export.run_pass(settle=0.0) == 2
    export.stop(flush=False)
    sent = {uuid.UUID(attrs(s)["orgchart.task_id"]) for _, s in receiver.spans}
    assert sent == {root, child.id}
    assert old.root not in sent


def test_orgchart_run_with_a_collector_that_is_down_still_succeeds(
        orgchart_env: dict[str, str]) -> None:
    import json
    import socket

    from tests.integration.test_run_acceptance import GOAL, orgchart

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**orgchart_env, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
    res = orgchart(env, "run", GOAL, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["status"] == "done"
    assert "the trace export of tree" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr  # one line, not a stack


def test_the_exporters_lock_is_one_session_at_a_time_and_dies_with_its_session(
        store: Store) -> None:
    first = store.hygiene.session_lock(traces.LOCK_KEY)
    second = store.hygiene.session_lock(traces.LOCK_KEY)
    try:
        assert first.try_acquire() and first.try_acquire()  # held: answers without asking
        assert not second.try_acquire()
        first.release()
        assert second.try_acquire()  # released: another process takes over
        with store.database.transaction() as conn:  # the holder's session dies (a killed process)
            conn.execute(sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_locks "
                "WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()"))
        for _ in range(50):
            if first.try_acquire():
                break
            time.sleep(0.1)  # the server ends the killed session's locks asynchronously
        assert first.held
    finally:
        first.release()
        second.release()
