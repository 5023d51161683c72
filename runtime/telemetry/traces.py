"""OpenTelemetry traces built from the database rows, exported over OTLP/HTTP.

A root and its tree are one trace: the trace id is the root id's 128 bits, a task's
span id is the first 8 bytes of sha256 of its id, so any process can add spans to a
tree's trace and a task run twice (re-delivered after a crash) is still one span. A
task's span runs from ``created_at`` to ``completed_at``; its parent span is its
parent task's; its transitions (``task_events``) are span events at their times. Each
model call is a child span following the OpenTelemetry GenAI semantic conventions.

Spans are built when a task ends, from what the database holds, so a crashed worker
loses nothing. The exporter is the official ``opentelemetry-exporter-otlp-proto-http``
(configured by the standard ``OTEL_EXPORTER_OTLP_*`` variables); since the SDK would
give spans ids of its own, the spans are ``ReadableSpan`` objects with the ids above,
handed to the exporter's ``export()``.

Nothing from ``opentelemetry`` is imported unless an OTLP endpoint is configured
(:func:`otlp_configured`): the imports are inside the functions that need them.

Delivery (:class:`TraceExport`): a background thread exports the tasks whose final
transition has a ``task_events`` id above the cursor. The cursor is a row of
``export_cursors`` (``traces``), created the first time an exporter runs at the newest
event, or before the oldest recent tree still open (finished history is not sent;
:func:`export_tree` exports a past tree on demand), and advanced after each batch is
sent. Only one process exports at a time (the store's session lock,
``store.hygiene.session_lock``), so several workers do not send the same spans; a process
that takes over, or restarts after a crash, reads the cursor and goes on from there: a
tree that ended while no exporter ran is still sent, at least once (a batch sent just
before a crash is sent again, with the same span ids). Events younger than
:data:`SETTLE_SECONDS` wait for the next pass (ids are taken at insert time, so a slower
transaction may still commit a lower id). A task that ends again (a
resolved escalation, a parent's retry) is exported again with the same span id.

A command that finishes a tree and exits (``orgchart run``) calls
:func:`finish_tree_export` before it returns: its tree is sent whole, whether or not
this process leads. The span resource is built when the exporter starts, so a last
pass still works while the interpreter shuts down (``stop_trace_export`` at exit).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from runtime.store.store import Store

log = logging.getLogger(__name__)

#: Final transitions younger than this wait for the next pass (see the module doc).
SETTLE_SECONDS = 2.0
#: How often the exporter thread looks for tasks that ended.
INTERVAL_SECONDS = 2.0
#: Tasks per export call.
BATCH = 500
#: The exporter's row in ``export_cursors``.
CURSOR_NAME = "traces"
#: The advisory lock that makes one process the exporter.
LOCK_KEY = 0x6F7267_7472616365  # "org" "trace"
#: The first exporter of a database also sends the trees begun this recently that are
#: still open (their tasks that ended before it started): see ``store.reads.export_cursor``.
OPEN_TREE_WINDOW_SECONDS = 3600.0
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_FINAL = ("done", "failed", "escalated")


def otlp_configured(env: Mapping[str, str] | None = None) -> bool:
    """Whether traces should be exported: an OTLP endpoint is set and nothing disables it."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return any(env.get(name, "").strip() for name in _ENDPOINT_VARS)


def trace_id_for(root_id: uuid.UUID) -> int:
    """A tree's trace id: the root id's 128 bits."""
    return root_id.int


def span_id_for(task_id: uuid.UUID) -> int:
    """A task's span id: the first 8 bytes of sha256 of its id (never 0)."""
    value = int.from_bytes(hashlib.sha256(task_id.bytes).digest()[:8], "big")
    return value or 1


def call_span_id_for(call_id: int) -> int:
    """A model call's span id, from its ``model_calls`` id (never 0)."""
    digest = hashlib.sha256(b"orgchart.model_call:" + str(call_id).encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


def step_span_id_for(step_id: int) -> int:
    """A step's (or tool call's) span id, from its ``task_steps`` id (never 0)."""
    digest = hashlib.sha256(b"orgchart.step:" + str(step_id).encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


def _step_span(s: Mapping[str, Any], parent: Any, resource: Any, scope: Any) -> Any:
    """An ``execute_tool <name>`` span for a tool call (``step <name>`` for a step)."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

    tool = s["kind"] == "tool"
    attributes: dict[str, Any] = {
        "orgchart.step.position": str(s["position"]), "orgchart.step.starts": int(s["starts"]),
        "orgchart.step.replays": int(s["replays"]), "orgchart.cost_usd": _num(s["cost_usd"]),
    }
    if tool:
        attributes.update({"gen_ai.operation.name": "execute_tool",
                           "gen_ai.tool.name": s["name"], "gen_ai.tool.type": "function",
                           "gen_ai.tool.call.id": str(s["tool_call_id"] or s["position"])})
    if s["error"]:
        attributes["error.type"] = str(s["error"]).split(":", 1)[0][:200]
    return ReadableSpan(
        name=f"execute_tool {s['name']}" if tool else f"step {s['name']}",
        context=SpanContext(parent.trace_id, step_span_id_for(s["id"]), False,
                            parent.trace_flags),
        parent=parent, resource=resource, attributes=attributes, kind=SpanKind.INTERNAL,
        status=Status(StatusCode.ERROR, str(s["error"])[:200]) if s["error"]
        else Status(StatusCode.UNSET),
        start_time=_ns(s["started_at"]), end_time=_ns(s["finished_at"]),
        instrumentation_scope=scope)


def _ns(value: dt.datetime) -> int:
    return int(value.timestamp() * 1_000_000) * 1000


def _num(value: Any) -> float:
    return float(Decimal(value or 0))


def _resource() -> Any:
    """The ``Resource`` every span carries, built once per process.

    Built when the exporter starts (:class:`TraceExport`), never first at exit:
    ``Resource.create`` runs its detectors in a thread pool, which refuses new work once
    the interpreter has begun shutting down.
    """
    global _RESOURCE
    if _RESOURCE is None:
        from opentelemetry.sdk.resources import Resource

        attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "orgchart"}
        _RESOURCE = Resource.create(attrs)
    return _RESOURCE


_RESOURCE: Any = None


def _task_attributes(t: Mapping[str, Any]) -> dict[str, Any]:
    """A task span's attributes: ids, agent, status, spend, deliveries, verdict, route."""
    attributes: dict[str, Any] = {
        "orgchart.task_id": str(t["id"]), "orgchart.root_id": str(t["root_id"]),
        "orgchart.agent": t["to_agent"], "orgchart.type": t["type"],
        "orgchart.status": t["status"], "orgchart.depth": int(t["depth"]),
        "orgchart.spent_tokens": int(t["spent_tokens"]),
        "orgchart.spent_usd": _num(t["spent_usd"]),
        "orgchart.own_tokens": int(t["own_tokens"]),
        "orgchart.own_usd": _num(t["own_usd"]),
        "orgchart.deliveries": int(t["delivery_count"]),
        "orgchart.retries": int(t["retry_count"]),
    }
    verdict = t["verdict"]
    if isinstance(verdict, dict) and "passed" in verdict:
        attributes["orgchart.verdict.passed"] = bool(verdict["passed"])
        if isinstance(verdict.get("score"), int | float):
            attributes["orgchart.verdict.score"] = float(verdict["score"])
    for key in ("route", "model", "error"):
        if t[key]:
            attributes[f"orgchart.{key}"] = str(t[key])[:1000]
    return attributes


def _call_attributes(c: Mapping[str, Any]) -> dict[str, Any]:
    """A model call span's attributes (the OpenTelemetry GenAI conventions, and ours)."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.system": "ollama" if c["backend"] in ("ollama", "offline")
        else str(c["backend"]),
        "gen_ai.request.model": c["model"], "gen_ai.response.model": c["model"],
        "gen_ai.usage.input_tokens": int(c["prompt_tokens"]),
        "gen_ai.usage.output_tokens": int(c["completion_tokens"]),
        "orgchart.route": c["route"], "orgchart.cost_usd": _num(c["cost_usd"]),
        "orgchart.backend": c["backend"], "orgchart.attempt": int(c["attempt"]),
        "orgchart.call_index": int(c["call_index"]),
        # Served from the record (a redelivery, or a fork's unchanged call): free.
        "orgchart.replayed": bool(c.get("replayed")),
    }
    if c["error"]:
        attributes["error.type"] = str(c["error"])[:200]
    return attributes


def _task_spans(t: Mapping[str, Any], history: list[dict[str, Any]],
                calls: list[dict[str, Any]], resource: Any,
                steps: list[dict[str, Any]] | None = None) -> list[Any]:
    """One ended task's span, then one child span per model call and per step of it."""
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    scope = InstrumentationScope("orgchart", "0.1.0")
    flags = TraceFlags(TraceFlags.SAMPLED)
    end = t["completed_at"] or history[-1]["at"]
    trace_id = trace_id_for(t["root_id"])
    context = SpanContext(trace_id, span_id_for(t["id"]), False, flags)
    parent = (SpanContext(trace_id, span_id_for(t["parent_id"]), False, flags)
              if t["parent_id"] else None)
    span_events = [Event(e["to_status"], {
        k: str(v)[:1000] for k, v in (("orgchart.from_status", e["from_status"]),
                                       ("orgchart.worker", e["worker"]),
                                       ("orgchart.detail", e["detail"])) if v is not None
    }, timestamp=_ns(e["at"])) for e in history]
    status = (Status(StatusCode.OK) if t["status"] == "done"
              else Status(StatusCode.ERROR, (t["error"] or t["status"])[:200]))
    spans = [ReadableSpan(
        name=t["to_agent"], context=context, parent=parent, resource=resource,
        attributes=_task_attributes(t), events=span_events, kind=SpanKind.INTERNAL,
        status=status, start_time=_ns(t["created_at"]), end_time=_ns(end),
        instrumentation_scope=scope)]
    for c in calls:
        finished = c["created_at"]
        started = finished - dt.timedelta(seconds=float(c["duration_seconds"] or 0))
        spans.append(ReadableSpan(
            name=f"chat {c['model']}",
            context=SpanContext(trace_id, call_span_id_for(c["id"]), False, flags),
            parent=context, resource=resource, attributes=_call_attributes(c),
            kind=SpanKind.CLIENT,
            status=Status(StatusCode.ERROR, str(c["error"])[:200]) if c["error"]
            else Status(StatusCode.UNSET),
            start_time=_ns(started), end_time=_ns(finished), instrumentation_scope=scope))
    spans += [_step_span(s, context, resource, scope) for s in steps or ()
              if s["finished_at"] is not None]
    return spans


def build_spans(rows: Mapping[str, list[dict[str, Any]]]) -> list[Any]:
    """``ReadableSpan`` objects for the tasks (and their model calls) in ``rows``.

    ``rows`` is what :meth:`store.reads.trace_rows` returns. Tasks that have not ended are
    left out (a span is exported once it has an end).
    """
    resource = _resource()
    events: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in rows["events"]:
        events[e["task_id"]].append(e)
    calls: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for c in rows["model_calls"]:
        calls[c["task_id"]].append(c)
    steps: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for s in rows.get("steps", ()):
        steps[s["task_id"]].append(s)
    spans: list[Any] = []
    for t in rows["tasks"]:
        history = events.get(t["id"], [])
        if t["status"] in _FINAL and (t["completed_at"] or history):
            spans += _task_spans(t, history, calls.get(t["id"], []), resource,
                                 steps.get(t["id"]))
    return spans


def new_exporter() -> Any:
    """The official OTLP/HTTP (protobuf) span exporter, configured by ``OTEL_*``."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def export_tasks(store: Store, task_ids: Iterable[uuid.UUID], exporter: Any = None) -> int:
    """Export the spans of the given (finished) tasks; return how many spans were sent.

    Raises:
        RuntimeError: the exporter reported a failure.

    """
    from opentelemetry.sdk.trace.export import SpanExportResult

    exporter = exporter or new_exporter()
    ids = list(dict.fromkeys(task_ids))
    sent = 0
    for i in range(0, len(ids), BATCH):
        spans = build_spans(store.reads.trace_rows(ids[i:i + BATCH]))
        if spans and exporter.export(spans) is not SpanExportResult.SUCCESS:
            raise RuntimeError(f"the OTLP exporter refused {len(spans)} spans")
        sent += len(spans)
    return sent


def export_tree(store: Store, root_id: uuid.UUID, exporter: Any = None) -> int:
    """Export every finished task of one tree (a backfill); return the spans sent."""
    return export_tasks(store, store.reads.tree_ids(root_id), exporter)


class TraceExport:
    """The background exporter: tasks whose final transition is newer than the cursor.

    Args:
        store: where the rows are read (and the exporter's advisory lock is taken).
        exporter: the span exporter (default: :func:`new_exporter`).
        interval: seconds between passes.
        settle: final transitions younger than this wait for the next pass.

    """

    def __init__(self, store: Store, exporter: Any = None, interval: float = INTERVAL_SECONDS,
                 settle: float = SETTLE_SECONDS) -> None:
        self.store = store
        self.exporter = exporter or new_exporter()
        _resource()  # now, not first at exit (see _resource)
        self.interval = interval
        self.settle = settle
        # The recorded cursor (created now if no exporter ever ran: see
        # store.reads.export_cursor); read again whenever this process starts to lead.
        self.cursor = store.reads.export_cursor(CURSOR_NAME, OPEN_TREE_WINDOW_SECONDS)
        self.exported = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = store.hygiene.session_lock(LOCK_KEY)
        self._pass_lock = threading.Lock()

    def _lead(self) -> bool:
        """Hold the exporter's advisory lock (one process exports at a time)."""
        if self._lock.held:
            return True
        if self._lock.try_acquire():  # go on from where the last exporter left off
            self.cursor = self.store.reads.export_cursor(CURSOR_NAME, OPEN_TREE_WINDOW_SECONDS)
        return self._lock.held

    def _drop_connection(self) -> None:
        # Closed for real, not handed back to the pool: that ends the session and with it
        # the advisory lock, so another exporter can take over now.
        self._lock.release()

    def run_pass(self, settle: float | None = None,
                 sent_ids: set[uuid.UUID] | None = None) -> int:
        """Export what ended since the cursor (if this process leads); spans sent.

        ``sent_ids``, when given, collects the ids of the tasks exported.
        """
        with self._pass_lock:
            if not self._lead():
                return 0
            sent = 0
            while True:
                ended = self.store.reads.ended_after(self.cursor, self.settle if settle is None
                                                     else settle, BATCH)
                if not ended:
                    return sent
                ids = [r["task_id"] for r in ended]
                batch = export_tasks(self.store, ids, self.exporter)
                self.cursor = int(ended[-1]["id"])
                self.store.reads.advance_export_cursor(CURSOR_NAME, self.cursor)
                self.exported += batch
                sent += batch
                if sent_ids is not None:
                    sent_ids.update(ids)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.run_pass()
            except Exception:
                log.warning("trace export pass failed; retrying next pass", exc_info=True)
                self._drop_connection()

    def start(self) -> TraceExport:
        """Start the background thread (a daemon); return self."""
        self._thread = threading.Thread(target=self._loop, name="orgchart-trace-export",
                                        daemon=True)
        self._thread.start()
        return self

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)

    def stop(self, flush: bool = True) -> None:
        """Stop the thread; with ``flush``, export what ended up to now first."""
        self._halt()
        try:
            if flush:
                self.run_pass(settle=0.0)
        except Exception:
            log.warning("the last trace export pass failed", exc_info=True)
        finally:
            self._drop_connection()
            self.exporter.shutdown()

    def finish_tree(self, root_id: uuid.UUID) -> int:
        """Stop, exporting one finished tree whole first (a short-lived command's exit).

        The leader runs its usual pass (the cursor moves past settled endings only),
        then every task of the tree not sent by it goes out directly, whatever the
        cursor: the tree's rows are final. A process that does not lead sends the tree
        too, so the tree arrives before the command exits; the leader may send it again
        later, with the same span ids. Returns the spans sent; never raises.
        """
        self._halt()
        sent_ids: set[uuid.UUID] = set()
        sent = 0
        try:
            sent += self.run_pass(sent_ids=sent_ids)
            rest = [i for i in self.store.reads.tree_ids(root_id) if i not in sent_ids]
            sent += export_tasks(self.store, rest, self.exporter)
        except Exception as exc:  # traces never fail the command: one line, no stack
            log.warning("the trace export of tree %s failed: %s", root_id, exc)
        finally:
            self._drop_connection()
            self.exporter.shutdown()
        return sent


_running: TraceExport | None = None
_start_lock = threading.Lock()


def start_trace_export(store: Store, env: Mapping[str, str] | None = None) -> TraceExport | None:
    """Start this process's trace exporter once, if an OTLP endpoint is configured.

    Returns None (and imports nothing from ``opentelemetry``) when it is not, and None
    with a warning when it cannot start (traces never stop a worker). A process stops it
    with :func:`stop_trace_export`, or :func:`finish_tree_export` for a command that
    finished a tree; an exit hook flushes what is left otherwise (the span resource is
    built at start, so that last pass works at shutdown).
    """
    global _running
    if not otlp_configured(env):
        return None
    with _start_lock:
        if _running is None:
            import atexit

            try:
                _running = TraceExport(store).start()
            except Exception:
                log.warning("OpenTelemetry trace export could not start; running without it",
                            exc_info=True)
                return None
            atexit.register(stop_trace_export)
        return _running


def running_trace_export() -> TraceExport | None:
    """The trace exporter running in this process, or None."""
    with _start_lock:
        return _running


def _take_running() -> TraceExport | None:
    global _running
    with _start_lock:
        running, _running = _running, None
    return running


def stop_trace_export() -> None:
    """Stop this process's trace exporter (exporting what ended first), if it runs."""
    running = _take_running()
    if running is not None:
        running.stop(flush=True)


def finish_tree_export(root_id: uuid.UUID) -> int:
    """Stop this process's exporter, sending the tree it just finished first; spans sent.

    For commands that finish a tree and exit (``orgchart run``): called before the
    command returns, not from an exit hook. Does nothing (0) when no exporter runs.
    """
    running = _take_running()
    return 0 if running is None else running.finish_tree(root_id)
