"""``orgchart.Client``: submit a goal, wait for its answer, steer it, answer its questions.

Over the database (``Client()``, ``Client("postgresql://...")``) or over ``orgchart
serve``'s HTTP API (``Client.http(url, token)``); the same methods and the same
:class:`Run` either way (:mod:`orgchart.transports`). See docs/client.md.

- :meth:`Client.submit` inserts a root goal and returns its :class:`Run` at once; the
  workers (``orgchart worker``, or the server's) run it. ``Run.warning`` says when no
  live worker would.
- :meth:`Client.run` submits and runs the tree in this process with a worker that claims
  that tree only (what ``orgchart run`` does, the same code:
  :func:`runtime.inprocess.run_tree`); over HTTP it waits for the server's workers.
- :meth:`Run.wait` reads the root's status, first after 5 ms, then less often (up to
  :data:`MAX_WAIT_POLL_SECONDS`), until it ends.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from types import TracebackType
from typing import Any

from orgchart.transports import DatabaseTransport, Goal, HttpTransport, Transport
from runtime.store.rows import TERMINAL_STATUSES
from runtime.store.streams import StreamEvent

#: The first wait between two reads of a root's status; doubled up to the most.
FIRST_WAIT_POLL_SECONDS = 0.005
MAX_WAIT_POLL_SECONDS = 0.25


def as_id(value: uuid.UUID | str) -> uuid.UUID:
    """A task id from a UUID or its text.

    Raises:
        ValueError: the text is not a UUID.

    """
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


class Run:
    """One submitted tree, named by its root; what it did once it ended.

    Attributes:
        id: the root task's id (the tree's ``root_id``).
        status: the root's status when last read (``pending`` ... ``done``, ``failed``,
            ``escalated``, ``cancelled``).
        result: the root's result (the answer) once done, else None.
        error: why the root failed or escalated, else None.
        cost_usd: what the whole tree spent, in dollars (estimated on the offline
            backend, as the tree's ``totals`` say).
        spent_tokens: the tokens the whole tree spent.
        served_by: model calls per backend that served them (``{"ollama": 9}``).
        created: False when an idempotency key returned an earlier submission.
        warning: set by ``submit`` when no live worker would run the goal.

    """

    def __init__(self, transport: Transport, task: dict[str, Any]) -> None:
        self.transport = transport
        self.id = as_id(task["id"])
        self.created: bool = bool(task.get("created", True))
        self.warning: str | None = task.get("warning")
        self._read(task)

    def _read(self, row: dict[str, Any]) -> None:
        totals = row.get("totals") or {}
        self.status: str = str(row["status"])
        self.result: Any = row.get("result")
        self.error: str | None = row.get("error")
        self.cost_usd = Decimal(str(totals.get("spent_usd", row.get("spent_usd")) or 0))
        self.spent_tokens = int(totals.get("spent_tokens", row.get("spent_tokens")) or 0)
        self.served_by: dict[str, int] = dict(totals.get("served_by")
                                              or row.get("served_by") or {})

    @property
    def finished(self) -> bool:
        """Whether the root has ended (done, failed, escalated or cancelled)."""
        return self.status in TERMINAL_STATUSES

    def refresh(self) -> Run:
        """Read the root again (status, result, the tree's spend); return this run."""
        self._read(self.transport.root(self.id))
        return self

    def wait(self, timeout: float | None = None) -> Run:
        """Wait until the root ends; return this run, finished.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the tree goes on running).

        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = FIRST_WAIT_POLL_SECONDS
        while True:
            self.status = self.transport.status(self.id)
            if self.finished:
                return self.refresh()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.id} is still {self.status} after {timeout:g}s")
            left = None if deadline is None else deadline - time.monotonic()
            time.sleep(pause if left is None else max(0.0, min(pause, left)))
            pause = min(pause * 2, MAX_WAIT_POLL_SECONDS)

    def tree(self) -> dict[str, Any]:
        """The whole tree as nested JSON (``orgchart tree --json``'s shape)."""
        return self.transport.tree(self.id)

    def cancel(self, note: str | None = None) -> dict[str, Any]:
        """Cancel the tree (every open task); what the command did."""
        return self.transport.steer("cancel", self.id, {"note": note})

    def pause(self, note: str | None = None) -> dict[str, Any]:
        """Pause the tree: no claims, no new model calls, until :meth:`resume`."""
        return self.transport.steer("pause", self.id, {"note": note})

    def resume(self) -> dict[str, Any]:
        """Resume the paused tree where it stood."""
        return self.transport.steer("resume", self.id, {})

    def __repr__(self) -> str:
        return f"Run(id={self.id}, status={self.status!r}, cost_usd={self.cost_usd})"


class Client:
    """Submit goals and follow them, over the database or over HTTP.

    Args:
        database_url: a PostgreSQL URL; None: ``ORGCHART_DATABASE_URL`` (or
            ``DATABASE_URL``, or ``[database] url``), else the embedded server under
            ``$ORGCHART_HOME`` (``./.orgchart``), as the CLI does. Migrated on first use.
        config: an ``orgchart.toml`` (default: ``ORGCHART_CONFIG`` or ``./orgchart.toml``).
        transport: a door of your own (tests); overrides the two above.

    """

    def __init__(self, database_url: str | None = None, *, config: str | None = None,
                 transport: Transport | None = None) -> None:
        self.transport: Transport = transport or DatabaseTransport(database_url, config)

    @classmethod
    def http(cls, url: str, token: str | None = None, *, http_client: Any = None) -> Client:
        """A client of ``orgchart serve`` at ``url`` (bearer ``token`` when it asks one).

        ``http_client`` is an ``httpx.Client`` to send through (FastAPI's TestClient).
        """
        return cls(transport=HttpTransport(url, token, http_client))

    def submit(self, goal: str, agent: str = "ceo", *, budget_tokens: int | None = None,
               budget_usd: Decimal | float | str | None = None,
               budget_seconds: int | None = None, priority: int = 5,
               payload: dict[str, Any] | None = None,
               success_criteria: dict[str, Any] | None = None,
               kill_criteria: dict[str, Any] | None = None,
               idempotency_key: str | None = None, tenant: str = "default",
               agents_module: Sequence[str] = ()) -> Run:
        """Submit a root goal; return its :class:`Run` at once (workers run it).

        Raises:
            BadInput: an unknown agent, a payload that fails its schema, a bad budget...
            IdempotencyConflict: the key names a different earlier request.

        """
        return Run(self.transport, self.transport.submit(Goal(
            goal, agent, budget_tokens, budget_usd, budget_seconds, priority, payload,
            success_criteria, kill_criteria, idempotency_key, tenant, tuple(agents_module))))

    def run(self, goal: str, agent: str = "ceo", *, timeout: float | None = None,
            max_in_flight: int | None = None, **options: Any) -> Run:
        """Submit a goal, run its tree in this process, return the finished :class:`Run`.

        A worker in this process claims that tree only (never a goal someone else
        queued); over HTTP the server's workers run it and this waits. ``options`` are
        :meth:`submit`'s.

        Raises:
            TimeoutError: the root had not ended after ``timeout`` seconds.

        """
        deadline = None if timeout is None else time.monotonic() + timeout
        run = self.submit(goal, agent, **options)
        spec = Goal(goal, agent, agents_module=tuple(options.get("agents_module", ())))
        self.transport.run(spec, run.id, timeout, max_in_flight)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return run.wait(left)

    def get(self, root_id: uuid.UUID | str) -> Run:
        """The :class:`Run` of a tree submitted earlier (by anyone), read now."""
        return Run(self.transport, {**self.transport.root(as_id(root_id)), "created": False})

    def inbox(self) -> list[dict[str, Any]]:
        """What waits for a person, oldest first: questions, approvals, escalations.

        Each item is ``GET /inbox``'s shape: ``kind``, ``id``, ``question``,
        ``answer_schema``, ``choices``, ``root_id``, ...
        """
        return self.transport.inbox()

    def answer(self, task_id: uuid.UUID | str, answer: Any, *, by: str | None = None
               ) -> dict[str, Any]:
        """Answer a question to ``human`` (checked against its schema and choices).

        Raises:
            SteeringRefused: the answer does not fit, or the task is no open question.

        """
        return self.transport.steer("answer", as_id(task_id), {"answer": answer, "by": by})

    def stream(self, root_id: uuid.UUID | str, *, after: str | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[StreamEvent]:
        """A tree's events as they happen: its model calls' text and its transitions.

        Yields :class:`~runtime.store.streams.StreamEvent` (``kind``: ``text``,
        ``superseded`` or ``transition``; ``id``; ``data``, as ``GET
        /trees/{root_id}/stream`` sends them) until the root's terminal transition;
        ``after`` resumes after an event's ``id`` (every later event comes once);
        ``stop`` is checked after each event (True ends the iteration).

        Raises:
            NotFound: no tree has that root.
            BadInput: ``after`` is no event id of a stream.

        """
        return self.transport.stream(as_id(root_id), after, stop)

    def close(self) -> None:
        """Release the connections (the embedded server stops with the last user)."""
        self.transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
