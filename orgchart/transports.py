"""The two doors a client goes through: the database itself, or ``orgchart serve``'s API.

Both answer the same calls with the same JSON shapes (those of :mod:`runtime.views`, as
the CLI and the HTTP API print them), so :class:`orgchart.client.Client` and
:class:`orgchart.client.Run` are written once over :class:`Transport`.

- :class:`DatabaseTransport` opens a :class:`~runtime.store.store.Store` on a database
  URL (the embedded PostgreSQL when none is named, as the CLI does) and calls what the
  CLI calls; its :meth:`~DatabaseTransport.run` runs the tree in this process.
- :class:`HttpTransport` speaks the HTTP API (``httpx``) with an optional bearer token;
  its ``run`` waits while the server's workers run the tree.

Errors: bad input raises :class:`~runtime.errors.BadInput` (422 over HTTP), a missing
task :class:`~runtime.store.rows.NotFound` (404), a reused idempotency key
:class:`~runtime.store.rows.IdempotencyConflict` (409), a refused steering command
:class:`~runtime.store.steering.SteeringRefused` (422 or 409); other HTTP failures raise
:class:`RequestFailed` with the status and the server's message.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Protocol

from runtime.errors import BadInput
from runtime.store.rows import IdempotencyConflict, NotFound
from runtime.store.steering import SteeringRefused
from runtime.store.streams import Position, StreamEvent, follow

#: Seconds an HTTP request may take before the client gives up on it.
HTTP_TIMEOUT_SECONDS = 30.0
#: Times a tree's stream is opened again in a row, with no event between, before the
#: client gives up (the pause doubles from 0.1 s up to 2 s).
STREAM_RECONNECTS = 5


class RequestFailed(Exception):
    """The HTTP API answered with an error the client has no closer type for.

    Attributes:
        status_code: the HTTP status.
        message: the server's ``error`` message.

    """

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message


@dataclass(frozen=True)
class Goal:
    """A root goal and how to run it: what ``submit`` and ``run`` take."""

    goal: str
    agent: str = "ceo"
    budget_tokens: int | None = None
    budget_usd: Decimal | float | str | None = None
    budget_seconds: int | None = None
    priority: int = 5
    payload: dict[str, Any] | None = None
    success_criteria: dict[str, Any] | None = None
    kill_criteria: dict[str, Any] | None = None
    idempotency_key: str | None = None
    tenant: str = "default"
    agents_module: Sequence[str] = field(default_factory=tuple)


class Transport(Protocol):
    """What a client needs from its door (the database or the HTTP API)."""

    def submit(self, goal: Goal) -> dict[str, Any]:
        """Submit a root goal; the created task (``created``, maybe ``warning``)."""

    def status(self, root_id: uuid.UUID) -> str:
        """The root's status now (cheap: read while waiting)."""

    def root(self, root_id: uuid.UUID) -> dict[str, Any]:
        """The root task with its result and the whole tree's ``totals``."""

    def tree(self, root_id: uuid.UUID) -> dict[str, Any]:
        """The whole tree, nested (``GET /trees/{root_id}``)."""

    def run(self, goal: Goal, root_id: uuid.UUID, timeout: float | None,
            max_in_flight: int | None) -> str:
        """Run (or wait for) the tree of ``root_id`` until its root ends; its status."""

    def steer(self, action: str, task_id: uuid.UUID, body: dict[str, Any]) -> dict[str, Any]:
        """Cancel, pause, resume or answer; what the command did."""

    def inbox(self) -> list[dict[str, Any]]:
        """What waits for a person (``GET /inbox``)."""

    def stream(self, root_id: uuid.UUID, after: str | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[StreamEvent]:
        """A tree's stream after event ``after`` (None: from its start), until it ends."""

    def close(self) -> None:
        """Release connections."""


class DatabaseTransport:
    """The database as the door: the CLI's own calls, in this process.

    Args:
        database_url: a PostgreSQL URL; None: ``ORGCHART_DATABASE_URL``/``DATABASE_URL``,
            ``[database] url``, else the embedded server under ``$ORGCHART_HOME``.
        config: an ``orgchart.toml`` to read (default: as the CLI finds it).

    """

    def __init__(self, database_url: str | None = None, config: str | None = None) -> None:
        from runtime.config import load_settings
        from runtime.wiring import open_store

        env = dict(os.environ)
        if database_url is not None:
            env["ORGCHART_DATABASE_URL"] = database_url
        self.settings = load_settings(config, env=env)
        self.store = open_store(self.settings)
        self._runtimes: dict[tuple[str, ...], Any] = {}

    def _registry(self, modules: Sequence[str]) -> Any:
        from runtime.wiring import load_registry

        if tuple(modules) in self._runtimes:
            return self._runtimes[tuple(modules)].registry
        return load_registry(self.settings, modules)

    def runtime(self, modules: Sequence[str]) -> Any:
        """The full runtime (model backend included) for ``modules``, built once."""
        from runtime.wiring import build_runtime

        key = tuple(modules)
        if key not in self._runtimes:
            self._runtimes[key] = build_runtime(self.settings, list(key), store=self.store)
        return self._runtimes[key]

    def submit(self, goal: Goal) -> dict[str, Any]:
        """Validate and insert the root (as ``orgchart submit``); the task as JSON."""
        from runtime.views import task_json
        from runtime.wiring import build_root

        options: dict[str, Any] = {k: v for k, v in (
            ("budget_tokens", goal.budget_tokens), ("budget_usd", goal.budget_usd),
            ("budget_seconds", goal.budget_seconds)) if v is not None}
        new = build_root(self._registry(goal.agents_module), self.settings, goal=goal.goal,
                         agent=goal.agent, priority=goal.priority, payload=goal.payload,
                         success=goal.success_criteria, kill=goal.kill_criteria,
                         idempotency_key=goal.idempotency_key, tenant=goal.tenant, **options)
        task, created = self._submit(new)
        warning = self.store.claims.no_worker_warning(
            new.to_agent, self.settings.worker.maintenance_interval_seconds)
        return {**task_json(task), "created": created, "warning": warning}

    def _submit(self, new: Any) -> tuple[dict[str, Any], bool]:
        from runtime.wiring import submit_root

        return submit_root(self.store, new, "client",
                           self.settings.database.failover_timeout_seconds)

    def status(self, root_id: uuid.UUID) -> str:
        """The root's status (one read of its row)."""
        return str(self.store.reads.get(root_id)["status"])

    def root(self, root_id: uuid.UUID) -> dict[str, Any]:
        """The root with its result and the whole tree's ``totals`` (one tree read)."""
        return self.tree(root_id)

    def tree(self, root_id: uuid.UUID) -> dict[str, Any]:
        """The whole tree, nested."""
        from runtime.views import tree_text

        text, _ = tree_text(self.store, root_id, None, None, "full")
        return dict(json.loads(text))

    def run(self, goal: Goal, root_id: uuid.UUID, timeout: float | None,
            max_in_flight: int | None) -> str:
        """Run the tree here: a worker that claims this tree only (``orgchart run``'s).

        Raises:
            TimeoutError: the root had not ended after ``timeout`` seconds.
            RuntimeError: the worker stopped before the root ended (its log says why).

        """
        from runtime.inprocess import run_tree
        from runtime.store.rows import TERMINAL_STATUSES

        started = time.monotonic()
        status = run_tree(self.runtime(goal.agents_module), root_id, timeout=timeout,
                          max_in_flight=max_in_flight)
        if status in TERMINAL_STATUSES:
            return status
        if timeout is not None and time.monotonic() - started >= timeout:
            raise TimeoutError(f"run {root_id} is still {status} after {timeout:g}s")
        raise RuntimeError(f"the worker of run {root_id} stopped while it was {status} "
                           "(its log says why)")

    def steer(self, action: str, task_id: uuid.UUID, body: dict[str, Any]) -> dict[str, Any]:
        """Cancel, pause, resume or answer, as the CLI does."""
        from runtime.views import steer_json
        from runtime.wiring import check_storable

        check_storable(body, "the request")
        by = body.get("by") or "client"
        outcome: Any
        if action == "cancel":
            outcome = self.store.steering.cancel(task_id, actor=by, note=body.get("note"))
        elif action == "pause":
            outcome = self.store.steering.pause(task_id, actor=by, note=body.get("note"))
        elif action == "resume":
            outcome = self.store.steering.resume(task_id, actor=by)
        else:
            outcome = self.store.steering.answer(task_id, body["answer"], actor=by)
        return steer_json(outcome)

    def inbox(self) -> list[dict[str, Any]]:
        """What waits for a person, oldest first."""
        from runtime.views import inbox_json

        return [inbox_json(r) for r in self.store.steering.inbox()]

    def stream(self, root_id: uuid.UUID, after: str | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[StreamEvent]:
        """Read the tree's stream from the database (what ``orgchart follow`` reads).

        Raises:
            NotFound: ``root_id`` is no tree's root.
            BadInput: ``after`` is no event id of a stream.

        """
        position = Position.parse(after)
        reader = self.store.streams
        if not reader.exists(root_id):
            raise NotFound(f"no tree with root {root_id}")
        yield from follow(reader, root_id, position, stop=stop)

    def close(self) -> None:
        """Dispose of the store's connections."""
        self.store.dispose()


#: The path of each steering action on the HTTP API (``{id}`` is the task or root).
_STEER_PATHS = {"cancel": "/tasks/{id}/cancel", "pause": "/trees/{id}/pause",
                "resume": "/trees/{id}/resume", "answer": "/tasks/{id}/answer"}


class HttpTransport:
    """``orgchart serve``'s HTTP API as the door.

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``).
        token: the bearer token (``ORGCHART_API_TOKEN`` on the server), if it asks one.
        http: an ``httpx.Client`` to use instead of a new one (tests pass FastAPI's).

    """

    def __init__(self, url: str, token: str | None = None, http: Any = None) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if http is None:
            http = httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_SECONDS)
        http.headers.update(headers)
        self.http = http

    def _call(self, method: str, path: str, refused: type[Exception] = BadInput,
              conflict: Callable[[str], Exception] | None = None, **kwargs: Any) -> Any:
        """One request; an error status raised as the database door would raise it."""
        response = self.http.request(method, path, **kwargs)
        if response.status_code < 400:
            return response.json()
        raise _error_of(response, refused, conflict)

    def stream(self, root_id: uuid.UUID, after: str | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[StreamEvent]:
        """``GET /trees/{root_id}/stream``, reconnecting with ``Last-Event-ID`` on a drop.

        Ends at the server's ``end`` message. A connection that breaks is opened again
        after the last event received (every later event comes once), up to
        :data:`STREAM_RECONNECTS` times in a row without an event in between.
        """
        import httpx

        last, failures = after, 0
        Position.parse(after)  # a malformed id fails here, not on the server
        while True:
            headers = {"Last-Event-ID": last} if last else {}
            try:
                with self.http.stream("GET", f"/trees/{root_id}/stream",
                                      headers=headers) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise _error_of(response, BadInput, None)
                    for kind, event_id, data in sse_messages(response.iter_lines()):
                        if kind == "end":
                            return
                        if event_id is None:
                            continue
                        last, failures = event_id, 0
                        yield StreamEvent(kind, Position.parse(event_id), json.loads(data))
                        if stop is not None and stop():
                            return
            except (httpx.TransportError, httpx.DecodingError):
                failures += 1
                if failures > STREAM_RECONNECTS:
                    raise
            else:
                failures += 1  # closed without its end message: reconnect
                if failures > STREAM_RECONNECTS:
                    raise RequestFailed(502, "the stream closed without its end message")
            time.sleep(min(0.05 * 2 ** failures, 2.0))

    def submit(self, goal: Goal) -> dict[str, Any]:
        """``POST /tasks`` (the server's agents: ``agents_module`` is refused)."""
        if goal.agents_module:
            raise BadInput("agents_module names modules to import here; over HTTP the "
                           "server loads its own agents ([agents] modules)")
        body: dict[str, Any] = {"prompt": goal.goal, "agent": goal.agent,
                                "priority": goal.priority, "tenant": goal.tenant}
        for name in ("budget_tokens", "budget_seconds", "payload", "success_criteria",
                     "kill_criteria"):
            if getattr(goal, name) is not None:
                body[name] = getattr(goal, name)
        if goal.budget_usd is not None:
            body["budget_usd"] = str(goal.budget_usd)
        headers = ({"Idempotency-Key": goal.idempotency_key}
                   if goal.idempotency_key is not None else {})

        def reused(message: str) -> Exception:
            named = re.search(r"task ([0-9a-f-]{36})", message)
            if named is None or goal.idempotency_key is None:
                return RequestFailed(409, message)
            return IdempotencyConflict(goal.idempotency_key, uuid.UUID(named[1]))

        return dict(self._call("POST", "/tasks", conflict=reused, json=body, headers=headers))

    def status(self, root_id: uuid.UUID) -> str:
        """The root's status (``GET /trees/{id}?depth=0&fields=summary``)."""
        return str(self._call("GET", f"/trees/{root_id}",
                              params={"depth": 0, "fields": "summary"})["status"])

    def root(self, root_id: uuid.UUID) -> dict[str, Any]:
        """The root with its result and the whole tree's ``totals``."""
        return self.tree(root_id)

    def tree(self, root_id: uuid.UUID) -> dict[str, Any]:
        """The whole tree, nested."""
        return dict(self._call("GET", f"/trees/{root_id}"))

    def run(self, goal: Goal, root_id: uuid.UUID, timeout: float | None,
            max_in_flight: int | None) -> str:
        """Nothing runs here over HTTP: the server's workers run the tree."""
        return self.status(root_id)

    def steer(self, action: str, task_id: uuid.UUID, body: dict[str, Any]) -> dict[str, Any]:
        """``POST`` the steering action."""
        return dict(self._call("POST", _STEER_PATHS[action].format(id=task_id),
                               refused=SteeringRefused, conflict=SteeringRefused, json=body))

    def inbox(self) -> list[dict[str, Any]]:
        """``GET /inbox``."""
        return list(self._call("GET", "/inbox"))

    def close(self) -> None:
        """Close the HTTP connections."""
        self.http.close()


def _error_of(response: Any, refused: type[Exception],
              conflict: Callable[[str], Exception] | None) -> Exception:
    """The error an HTTP error status stands for, as the database door would raise it."""
    try:
        message = str(response.json().get("error"))
    except ValueError:
        message = response.text[:500]
    if response.status_code == 404:
        return NotFound(message)
    if response.status_code == 422:
        return refused(message)
    if response.status_code == 409 and conflict is not None:
        return conflict(message)
    return RequestFailed(response.status_code, message)


def sse_messages(lines: Iterable[str]) -> Iterator[tuple[str, str | None, str]]:
    """``(event, id, data)`` of each Server-Sent Events message in ``lines``.

    Comment lines (``: keepalive``) and ``retry:`` are skipped; several ``data:`` lines
    are joined with newlines, as EventSource joins them.
    """
    kind, event_id = "message", None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield kind, event_id, "\n".join(data)
            kind, event_id, data = "message", None, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            kind = value
        elif name == "id":
            event_id = value
        elif name == "data":
            data.append(value)
