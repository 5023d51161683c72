"""The HTTP API and the live tree page, served by ``orgchart serve`` (FastAPI on uvicorn).

Endpoints (all JSON; shapes from :mod:`runtime.views`, documented in ``docs/api.md``):

- ``POST /tasks``: submit a root goal (``Idempotency-Key`` header deduplicates);
- ``GET /tasks/{id}``, ``GET /trees/{root_id}`` (``?under=&depth=``, ``/events``,
  ``/timeline``), ``GET /roots``, ``GET /escalations``, ``POST /tasks/{id}/resolve``;
- ``GET /metrics``, ``GET /healthz``; OpenAPI at ``/docs``; ``GET /`` and ``/ui/trees/{id}``;
  steering (cancel, pause, inbox, answers, approvals): ``runtime/http/steering.py``;
  forks and diffs (fork, branches, ``GET /diff/{a}/{b}``, ``/ui/diff/{a}/{b}``):
  ``runtime/http/forks.py``; a tree's text and transitions as Server-Sent Events
  (``GET /trees/{root_id}/stream``, ``?token=`` accepted for EventSource):
  ``runtime/http/stream.py``.

Errors are always ``{"error": "<message>"}``: 401 without the bearer token (when
``ORGCHART_API_TOKEN`` is set), 404 for a missing task, 405 with an ``Allow`` naming
every method of the path, 409 for a conflicting idempotency key, a refused resolution or
another conflict with a task's state, 413 for a body over :data:`MAX_BODY_BYTES`, 422
for a bad body (not JSON, not UTF-8, the wrong shape, a value out of its schema) or a
malformed id, 503 when the database is down, and 500 ``internal error`` for anything
else (logged with its traceback, never sent). The OpenAPI document lists each of these
on every operation that can answer it, carries the request models' constraints
(:mod:`runtime.http.constraints`) and the server's agents and models, and links a new
task to the operations that take its id (:mod:`runtime.http.document`).
"""

from __future__ import annotations

import hmac
import html
import json
import logging
import os
import re
import threading
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import sqlalchemy as sa
from fastapi import FastAPI, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agents.registry import Registry, UnknownAgent
from agents.tasks import DEFAULT_BUDGET_SECONDS, DEFAULT_BUDGET_TOKENS, DEFAULT_BUDGET_USD
from runtime.config import Settings
from runtime.constants import TENANT_NAME_PATTERN
from runtime.core.dberrors import refused_value
from runtime.errors import BadInput
from runtime.http.auth import API_TOKEN_ENV
from runtime.http.constraints import (
    MAX_INT,
    STORABLE_TEXT,
    Int,
    JsonObject,
    KillCriteria,
    NonBlankText,
    SuccessCriteria,
    Text,
    Tokens,
    Usd,
)
from runtime.http.document import choices_for, complete_document
from runtime.http.experiments import add_experiment_routes
from runtime.http.forks import add_fork_routes
from runtime.http.messages import validation_message
from runtime.http.schedules import add_schedule_routes
from runtime.http.steering import add_steering_routes
from runtime.http.stream import add_stream_routes
from runtime.http.webhooks import add_webhook_routes
from runtime.store.postgres.failover import DatabaseUnavailable
from runtime.store.rows import IdempotencyConflict, NotFound, ResolveRefused
from runtime.store.store import Store
from runtime.views import (
    escalation_json,
    task_detail_json,
    task_json,
    timeline_for,
    tree_changes_json,
    tree_text,
)
from runtime.wiring import MAX_GOAL_CHARS, check_storable

log = logging.getLogger(__name__)

#: Requests with a larger body are refused with 413 before they are read.
MAX_BODY_BYTES = 1_000_000
WEB_DIR = Path(__file__).with_name("web")
#: Static files the pages load (a whitelist: nothing else in ``web/`` is served).
STATIC_FILES = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8",
                "diff.js": "text/javascript; charset=utf-8",
                "experiment.js": "text/javascript; charset=utf-8",
                "dom.js": "text/javascript; charset=utf-8"}
#: Paths where ``?token=`` is accepted instead of the header (a browser cannot set it).
_PAGE_PREFIXES = ("/ui/", "/docs", "/openapi.json")
#: The tree stream takes ``?token=`` too: EventSource cannot send a header.
_STREAM_PATH = re.compile(r"/trees/[0-9A-Fa-f-]{32,36}/stream")
_PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
             "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
#: FastAPI's 400 for a JSON body it cannot read (bytes that are not UTF-8).
_UNREADABLE_BODY = "There was an error parsing the body"
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": text, "content": {"application/json": {"example": {"error": text}}}}
    for code, text in ((401, "missing or wrong bearer token"), (404, "no task ..."),
                       (422, "the request is malformed (the message says where)"))
}


# ---------------------------------------------------------------------- request bodies
class SubmitRequest(BaseModel):
    """``POST /tasks``: a root goal and how to run it."""

    model_config = ConfigDict(extra="forbid")

    prompt: NonBlankText = Field(..., max_length=MAX_GOAL_CHARS,
                                 description="The root goal (payload.goal).")
    agent: str = Field("ceo", description="The agent that receives the goal.")
    type: str | None = Field(None, description="Task type (default: the agent's first).")
    priority: Int = Field(5, ge=-1000, le=1000, description="Lower is more urgent.")
    tenant: str = Field("default", pattern=TENANT_NAME_PATTERN,
                        description="The tenant the tree runs under "
                        "([tenants.<name>] in orgchart.toml: weight, max_in_flight).")
    budget_tokens: Tokens = Field(DEFAULT_BUDGET_TOKENS, description="Tree-wide token budget.")
    budget_seconds: Int = Field(DEFAULT_BUDGET_SECONDS, ge=1, le=MAX_INT,
                                description="Seconds per run of each task.")
    budget_usd: Usd = Field(DEFAULT_BUDGET_USD,
                            description="Tree-wide USD budget (number or string).")
    payload: JsonObject | None = Field(None, description="Extra payload fields (the "
                                       "agent's input schema: see the oneOf).")
    success_criteria: SuccessCriteria | None = None
    kill_criteria: KillCriteria | None = None


class ResolveRequest(BaseModel):
    """``POST /tasks/{id}/resolve``: what to do with an escalated task.

    ``agent`` goes with ``reassign`` and only with it: the document says so with a
    ``oneOf`` (the server checks it here, so both say the same).
    """

    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"properties": {"action": {"enum": ["retry", "done", "fail"]},
                        "agent": {"type": "null"}}},
        {"properties": {"action": {"const": "reassign"}, "agent": {"type": "string"}},
         "required": ["agent"]},
    ]})

    action: Literal["retry", "done", "fail", "reassign"]
    agent: str | None = Field(None, description="The new agent (reassign only).")
    note: Text | None = Field(None, max_length=10_000, description="Kept in the history.")

    @model_validator(mode="after")
    def _agent_with_reassign_only(self) -> ResolveRequest:
        if self.action == "reassign" and not self.agent:
            raise ValueError("action 'reassign' needs 'agent': the agent to hand it to")
        if self.action != "reassign" and self.agent is not None:
            raise ValueError(f"'agent' is only used with action 'reassign', not {self.action!r}")
        return self


# ---------------------------------------------------------------------- responses
class _JSONResponse(JSONResponse):
    """JSON with ASCII escapes: a stray lone surrogate can never break the encoder."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, default=str,
                          separators=(",", ":")).encode("ascii")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return _JSONResponse({"error": message}, status_code=status, headers=headers)


async def _send_error(send: Send, status: int, message: str,
                      headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": message}, ensure_ascii=True).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------- middleware
class _Guard:
    """Bearer-token check, body size limit, and the last-resort 500 (pure ASGI)."""

    def __init__(self, app: ASGIApp, token: str | None, max_body: int) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.max_body = max_body

    def _authorized(self, scope: Scope) -> bool:
        assert self.token is not None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token):
                    return True
        path = scope.get("path", "")
        if scope.get("method") in ("GET", "HEAD") and (path == "/"
                                                       or path.startswith(_PAGE_PREFIXES)
                                                       or _STREAM_PATH.fullmatch(path)):
            query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
            for given in query.get("token", []):
                if hmac.compare_digest(given.encode(), self.token):
                    return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise HTTPException(413, f"the body is larger than {self.max_body} bytes")
            return message

        try:
            if self.token is not None and not self._authorized(scope):
                await _send_error(send, 401, "missing or wrong bearer token: send "
                                  "'Authorization: Bearer <token>' (pages: add ?token=<token>)",
                                  {"WWW-Authenticate": 'Bearer realm="orgchart"'})
                return
            length = dict(scope.get("headers", [])).get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                await _send_error(send, 413, f"the body is larger than {self.max_body} bytes"
                                  if length.isdigit() else "bad Content-Length header")
                return
            await self.app(scope, limited_receive, tracking_send)
        except Exception:
            log.exception("request failed", extra={"path": scope.get("path"),
                                                   "method": scope.get("method")})
            if not started:
                await _send_error(send, 500, "internal error")


# ---------------------------------------------------------------------- the app
def create_app(store: Store | None = None, settings: Settings | None = None,
               registry: Registry | None = None, api_token: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """Build the API on a store (opened from ``settings`` when not given).

    Args:
        store: the database door; default ``runtime.wiring.open_store(settings)``.
        settings: the configuration; default ``load_settings()``.
        registry: the agents roots may be submitted to; default built-ins plus
            ``[agents] modules``.
        api_token: the bearer token every request must carry; default
            ``ORGCHART_API_TOKEN`` (read now); None or empty means no authentication.
        max_body_bytes: larger request bodies get 413.

    """
    from runtime.config import load_settings
    from runtime.forks.branch import known_models
    from runtime.wiring import load_registry, open_store

    settings = settings or load_settings()
    registry = registry or load_registry(settings)
    store = store or open_store(settings)
    token = api_token if api_token is not None else os.environ.get(API_TOKEN_ENV) or None

    app = FastAPI(
        title="orgchart", version="0.1.0", docs_url=None, redoc_url=None,
        description="Submit root goals, inspect task trees, resolve escalations.",
        default_response_class=_JSONResponse,
    )
    app.state.store = store
    app.state.registry = registry
    app.add_middleware(_Guard, token=token, max_body=max_body_bytes)  # type: ignore[arg-type]
    _add_error_handlers(app)
    app.openapi = complete_document(  # type: ignore[method-assign]
        app.openapi, bool(token), choices_for(registry, known_models(settings)))
    _add_api_routes(app, store, settings, registry)
    add_steering_routes(app, store)
    page = _add_pages(app)
    add_fork_routes(app, store, settings, registry, page)
    add_experiment_routes(app, store, page)
    add_schedule_routes(app, store, settings, registry)
    add_webhook_routes(app, store, settings)
    add_stream_routes(app, store)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    async def validation(_: Request, exc: RequestValidationError) -> Response:
        return _error(422, validation_message(exc))

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = str(exc.detail)
        if exc.status_code == 400 and message == _UNREADABLE_BODY:
            # A malformed body is 422 everywhere, as when it is not JSON at all.
            return _error(422, f"the body is not valid JSON: {exc.__cause__ or 'unreadable'}")
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            return _error(405, message, {"Allow": _allowed_methods(request)})
        return _error(exc.status_code, message, dict(exc.headers or {}))

    async def not_found(_: Request, exc: Exception) -> Response:
        return _error(404, str(exc))

    async def conflict(_: Request, exc: Exception) -> Response:
        return _error(409, str(exc))

    async def bad_input(_: Request, exc: Exception) -> Response:
        return _error(422, str(exc))

    async def bad_data(_: Request, exc: Exception) -> Response:
        return _error(422, f"the database refused a value: {refused_value(exc) or 'invalid data'}")

    async def unavailable(_: Request, exc: Exception) -> Response:
        log.warning("database unavailable", extra={"error": str(exc)[:500]})
        return _error(503, "database unavailable")

    app.add_exception_handler(RequestValidationError, validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(NotFound, not_found)
    app.add_exception_handler(IdempotencyConflict, conflict)
    app.add_exception_handler(ResolveRefused, conflict)
    app.add_exception_handler(BadInput, bad_input)
    app.add_exception_handler(UnknownAgent, bad_input)
    app.add_exception_handler(sa.exc.DataError, bad_data)
    for cls in (DatabaseUnavailable, sa.exc.OperationalError, sa.exc.InterfaceError):
        app.add_exception_handler(cls, unavailable)


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at the request's path, for a 405's ``Allow``.

    Starlette answers 405 from the first route whose path matches, so its ``Allow``
    names that route's methods only: ``GET /schedules`` and ``POST /schedules`` are two
    routes, and ``Allow: GET`` would hide the POST.
    """
    methods: set[str] = set()
    for route in request.app.router.routes:
        regex, served = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and served and regex.match(request.url.path):
            methods |= set(served)
    return ", ".join(sorted(methods))


def _add_api_routes(app: FastAPI, store: Store, settings: Settings,
                    registry: Registry) -> None:
    from runtime.wiring import build_root, submit_root

    @app.post("/tasks", status_code=201, tags=["tasks"],
              responses={**_ERRORS, 200: {"description": "the key was seen: the same task"},
                         409: {"description": "the key is used by a different request"}})
    def submit_task(
        body: SubmitRequest,
        idempotency_key: str | None = Header(None, alias="Idempotency-Key", min_length=1,
                                             max_length=200, pattern=STORABLE_TEXT),
    ) -> Response:
        """Submit a root goal; 201 with the new task, 200 with the same task for a repeat."""
        check_storable(body.model_dump(mode="python"), "body")
        check_storable(idempotency_key, "the Idempotency-Key header")
        new = build_root(
            registry, settings, goal=body.prompt, agent=body.agent, type_=body.type,
            priority=body.priority, budget_tokens=body.budget_tokens,
            budget_seconds=body.budget_seconds, budget_usd=body.budget_usd,
            payload=body.payload, success=body.success_criteria, kill=body.kill_criteria,
            idempotency_key=idempotency_key, tenant=body.tenant,
        )
        task, created = submit_root(store, new, "api",
                                    settings.database.failover_timeout_seconds)
        content = {**task_json(task), "created": created}
        # A warning, not an error: a worker may start later (``warning`` only when so).
        warning = store.claims.no_worker_warning(new.to_agent,
                                                 settings.worker.maintenance_interval_seconds)
        if warning:
            content["warning"] = warning
        return _JSONResponse(content, status_code=201 if created else 200,
                             headers={"Location": f"/tasks/{task['id']}"})

    @app.get("/tasks/{task_id}", tags=["tasks"], responses=_ERRORS)
    def get_task(task_id: uuid.UUID, model_calls: bool = Query(
        False, description="Include the recorded model calls (prompts and responses)."),
    ) -> dict[str, Any]:
        """One task with its history (``events``) and children (``children``)."""
        return task_detail_json(store, task_id, model_calls=model_calls)

    @app.get("/trees/{root_id}", tags=["trees"], responses=_ERRORS)
    def get_tree(
        root_id: uuid.UUID,
        under: Annotated[uuid.UUID | None, Query(description="Only this task's subtree.")] = None,
        depth: Annotated[int | None, Query(
            ge=0, le=MAX_INT, description="Only this many levels below the top node.")] = None,
        fields: Annotated[Literal["full", "summary"], Query()] = "full",
    ) -> Response:
        """The tree under a root, nested, with ``totals`` on its top node.

        Built in the database in one query; ``fields=summary`` leaves out payloads,
        results and verdicts (docs/api.md). ``X-Orgchart-Last-Event``: the newest event id
        read; follow the tree from there with ``GET /trees/{root_id}/events?after=<id>``.
        """
        text, last_event = tree_text(store, root_id, under, depth, fields)
        return Response(text, media_type="application/json",
                        headers={"X-Orgchart-Last-Event": str(last_event)})

    @app.get("/trees/{root_id}/timeline", tags=["trees"], responses=_ERRORS)
    def get_tree_timeline(root_id: uuid.UUID) -> Response:
        """The tree on a time axis, with its critical path and one-line ``summary``.

        Each task has its queued/running/waiting/judging segments and its model calls.
        """
        return Response(timeline_for(store, root_id), media_type="application/json")

    @app.get("/trees/{root_id}/events", tags=["trees"], responses=_ERRORS)
    def get_tree_changes(
        root_id: uuid.UUID,
        after: int = Query(0, ge=0, description="A task_events id: changes after it."),
        limit: int = Query(5000, ge=1, le=50_000),
    ) -> dict[str, Any]:
        """What changed in a tree after event ``after``: the events and the changed tasks.

        ``tasks`` are the current rows (no ``children``) of every task named by
        ``events``; pass ``last_event_id`` as the next ``after``.
        """
        return tree_changes_json(store, root_id, after, limit)

    @app.get("/roots", tags=["trees"])
    def list_roots(limit: int = Query(50, ge=1, le=500)) -> list[dict[str, Any]]:
        """The most recent root tasks, newest first."""
        return [task_json(r) for r in store.reads.recent_roots(limit)]

    @app.get("/escalations", tags=["escalations"])
    def list_escalations() -> list[dict[str, Any]]:
        """Escalated tasks, oldest first, with the rule, root id and root goal."""
        return [escalation_json(r) for r in store.reads.escalations()]

    @app.post("/tasks/{task_id}/resolve", tags=["escalations"],
              responses={**_ERRORS, 409: {"description": "the task cannot be resolved so"}})
    def resolve_task(task_id: uuid.UUID, body: ResolveRequest) -> dict[str, Any]:
        """Resolve an escalated task: retry, done, fail, or reassign to another agent."""
        if body.agent is not None:  # the model saw to it that it goes with reassign
            check_storable(body.agent, "agent")
            registry.get(body.agent)
        check_storable(body.note, "note")
        task = store.transitions.resolve(task_id, body.action, actor="api", note=body.note,
                                         reassign_to=body.agent)
        return task_json(task)

    scrape: dict[str, Any] = {}
    scrape_lock = threading.Lock()

    @app.get("/metrics", tags=["operations"],
             responses={200: {"content": {"text/plain": {}, "application/openmetrics-text": {}},
                              "description": "JSON, or Prometheus text for a scrape"}})
    def get_metrics(accept: Annotated[str | None, Header()] = None) -> Any:
        """Tasks by status, average retries, reclaimed count, mean duration, cost by route.

        With ``Accept: text/plain`` or ``application/openmetrics-text`` (what Prometheus
        sends), the Prometheus exposition format instead (docs/operations.md).
        """
        fmt = _wants_prometheus(accept)
        if fmt is None:
            return store.reads.metrics()
        from runtime.telemetry import prometheus  # imported on the first scrape only

        with scrape_lock:
            if "registry" not in scrape:
                scrape["registry"] = prometheus.registry_for(store)
        body, content_type = prometheus.exposition(scrape["registry"], fmt)
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/healthz", tags=["operations"],
             responses={503: {"description": "the database does not answer"}})
    def healthz() -> dict[str, Any]:
        """200 when the database answers a trivial query, else 503."""
        store.ping()  # errors map to 503
        return {"status": "ok", "database": "ok"}


def _wants_prometheus(accept: str | None) -> str | None:
    """"openmetrics", "text" or None (JSON) for an ``Accept`` header."""
    accept = (accept or "").lower()
    if "application/openmetrics-text" in accept:
        return "openmetrics"
    return "text" if "text/plain" in accept else None


def _page(name: str, token_query: str, **values: str) -> str:
    text = (WEB_DIR / name).read_text(encoding="utf-8")
    text = text.replace("{{q}}", html.escape(token_query))
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", html.escape(value))
    return text


def _add_pages(app: FastAPI) -> Callable[..., HTMLResponse]:
    """Add the pages; return ``page(name, request, **values)`` for pages added elsewhere."""

    def token_query(request: Request) -> str:
        token = request.query_params.get("token")
        return "?" + urllib.parse.urlencode({"token": token}) if token else ""

    def html_page(text: str) -> HTMLResponse:
        return HTMLResponse(text, headers={"Content-Security-Policy": _PAGE_CSP,
                                           "X-Content-Type-Options": "nosniff",
                                           "Cache-Control": "no-store"})

    @app.get("/", include_in_schema=False)
    def index(request: Request) -> HTMLResponse:
        return html_page(_page("index.html", token_query(request)))

    @app.get("/ui/trees/{root_id}", include_in_schema=False)
    def tree_page(root_id: uuid.UUID, request: Request) -> HTMLResponse:
        return html_page(_page("tree.html", token_query(request), root_id=str(root_id)))

    @app.get("/ui/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise NotFound(f"no static file {name!r}")
        return Response((WEB_DIR / name).read_bytes(), media_type=STATIC_FILES[name],
                        headers={"Cache-Control": "no-cache",
                                 "X-Content-Type-Options": "nosniff"})

    @app.get("/docs", include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json" + token_query(request),
                                   title="orgchart API")

    return lambda name, request, **values: html_page(_page(name, token_query(request),
                                                           **values))
