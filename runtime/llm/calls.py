"""A model call's answer and its rows.

:class:`Completion` (what ``ctx.llm.complete`` returns), :class:`Rows` (the
``model_calls`` rows of a task's requests) and :class:`HeldReplays` (replayed calls'
rows held for the task's outcome).
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, TypeVar

from pydantic import BaseModel

from runtime.errors import BadInput
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.ledger import CallLedger
from runtime.llm.reply import Backend, ModelReply, ToolCall
from runtime.llm.request import Request
from runtime.llm.tool_loop import ToolOutcome
from runtime.records import ModelCharge


@dataclass(frozen=True)
class Completion:
    """One answered model call, as an agent sees it.

    Attributes:
        text: the reply text (JSON text for structured output), thinking excluded.
        data: the parsed reply when a schema was given (a JSON-ready dict for a pydantic
            model, validated by it), else None.
        prompt_tokens / completion_tokens: tokens of the request that answered (zero when
            replayed from the record).
        cost_usd: what the whole call cost (every attempt; zero when replayed).
        route / model / route_reason: where the call went and why.
        backend: ``ollama``, ``offline`` or ``replay``.
        offline: True when the answer came from the offline backend (not a model's work),
            directly or replayed from a run recorded offline.
        call_index: the call's order of issue in this task's run of the agent.
        position: the call's identity in the task (``key=``, else ``call_index``).
        attempts: requests made (1 + retries + repairs; 0 when replayed).
        replayed: True when served from the record of an earlier delivery.
        thinking: a thinking model's reasoning (``[ollama] think``), else None.
        tool_calls: the tools this reply asked to call (one round of a tool loop).
        tool_results: what the tool loop ran (``tools=``): one outcome per call, in order.
        tool_rounds: the rounds of tool calls the loop ran.

    """

    text: str
    data: Any
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal
    route: str
    model: str
    backend: str
    offline: bool
    route_reason: str = ""
    duration_seconds: float = 0.0
    call_index: int = 0
    position: str = "0"
    attempts: int = 1
    replayed: bool = False
    thinking: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_results: tuple[ToolOutcome, ...] = ()
    tool_rounds: int = 0


@dataclass(frozen=True)
class Rows:
    """Whose ``model_calls`` rows a task's requests are: builds each row to charge."""

    task_id: uuid.UUID
    lease_token: uuid.UUID
    attempt: int
    backend: str
    phase: str
    record: bool

    def row(self, call: Request, kind: str, reply: ModelReply | None, prompt_tokens: int,
            completion_tokens: int, duration: float, cost: Decimal,
            error: str | None) -> ModelCharge:
        """The row of one request of ``call`` (its text kept only when ``record``)."""
        kept = reply is not None and self.record
        return ModelCharge(
            task_id=self.task_id, lease_token=self.lease_token, attempt=self.attempt,
            call_index=call.call_index,
            backend=reply.backend if reply is not None else self.backend,
            route=call.route.route, route_reason=call.route.reason, model=call.route.model,
            prompt=call.stored_prompt, response=reply.text if kept and reply else None,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            duration_seconds=duration, cost_usd=cost, error=error, phase=self.phase,
            position=call.position, request_hash=call.request_hash, attempt_kind=kind,
            call_try=call.rows, thinking=reply.thinking if kept and reply else None,
            tool_calls=([c.as_json() for c in reply.tool_calls]
                        if reply is not None and reply.tool_calls else None))

    def replayed(self, call: Request, reply: ModelReply) -> ModelCharge:
        """The zero-cost ``replayed`` row of a call served from the record."""
        return replace(self.row(call, "call", reply, 0, 0, 0.0, Decimal(0), None),
                       replayed=True, call_try=0)


def replay_record(rows: Rows, call: Request, reply: ModelReply,
                  at: dt.datetime) -> dict[str, Any]:
    """A replayed call's row as JSON for the task's finishing write (``stamp["replays"]``).

    The columns of :meth:`Rows.replayed` the finishing statement does not fill itself
    (``replayed``, zero tokens and cost); ``at`` is when the call was served (the row's
    ``created_at``: the waterfall places it there, not at the finish).
    """
    kept = rows.record
    return {"attempt": rows.attempt, "call_index": call.call_index, "backend": reply.backend,
            "route": call.route.route, "route_reason": call.route.reason,
            "model": call.route.model, "prompt": call.stored_prompt,
            "response": reply.text if kept else None, "phase": rows.phase,
            "position": call.position, "request_hash": call.request_hash,
            "thinking": reply.thinking if kept else None,
            "tool_calls": ([c.as_json() for c in reply.tool_calls] if reply.tool_calls
                           else None),
            "at": at.isoformat()}


class HeldReplays:
    """Replayed calls' rows held for the task's finishing write (the executor's).

    A re-run replays a call per task: a write each, at call time, made a replayed tree
    slower than a tree of no-op agents. Once :meth:`defer` is called (the executor does,
    for a run or an aggregate: :func:`defer_replays`), the rows go with the task's
    outcome instead (:func:`held_replays`), in its transaction: a delivery that dies
    before its outcome writes none, and the next delivery replays (and records) the
    calls again. Without :meth:`defer`, each row is written at call time.
    """

    def __init__(self, ledger: CallLedger, lease_lost: threading.Event) -> None:
        self._ledger = ledger
        self._lease_lost = lease_lost
        self._held: list[tuple[Rows, Request, ModelReply, dt.datetime]] | None = None

    def defer(self) -> None:
        """From now on, hold the rows (:meth:`hold`) instead of writing them at once."""
        if self._held is None:
            self._held = []

    def hold(self, rows: Rows, call: Request, reply: ModelReply) -> bool:
        """Hold one replayed call's row; False when rows are not held (the caller writes it).

        Only what the row is made of is kept (the row is built by :func:`held_replays`).
        """
        if self._held is None:
            return False
        self._held.append((rows, call, reply, dt.datetime.now(dt.UTC)))
        return True

    def take(self) -> list[tuple[Rows, Request, ModelReply, dt.datetime]]:
        """The rows held so far (no longer held)."""
        held = self._held or []
        if self._held is not None:
            self._held = []
        return held

    def flush(self) -> None:
        """Write the held rows now (blocking): for an outcome that cannot carry them.

        Nothing is written once the lease is lost (the rows would be refused).
        """
        held = self.take()
        if not self._lease_lost.is_set():
            for rows, call, reply, _ in held:
                self._ledger.charge(rows.replayed(call, reply))


L = TypeVar("L")


def defer_replays(llm: L) -> L:
    """Make a task's model handle hold its replayed rows for its outcome; return it."""
    held = getattr(llm, "replays", None)
    if isinstance(held, HeldReplays):
        held.defer()
    return llm


def held_replays(llm: Any, carried: bool) -> list[dict[str, Any]]:
    """The replayed rows a task's outcome carries (``stamp["replays"]``).

    ``carried`` False: the outcome cannot carry them (a retry of children, a dropped
    task); they are written now instead, and none is returned.
    """
    held = getattr(llm, "replays", None)
    if not isinstance(held, HeldReplays):
        return []
    if carried:
        return [replay_record(*held_row) for held_row in held.take()]
    held.flush()
    return []


def is_offline(backend: Backend) -> bool:
    """Offline backend, or a replay of a run that was recorded offline."""
    return backend.name == OfflineBackend.name or bool(getattr(backend, "offline", False))


def schema_of(schema: Any) -> tuple[dict[str, Any] | None, type[BaseModel] | None]:
    """The JSON schema of a call's ``schema=`` argument, and its pydantic class if it is one."""
    if schema is None:
        return None, None
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema.model_json_schema(), schema
    if isinstance(schema, dict):
        return schema, None
    raise BadInput(f"schema must be a pydantic model class or a JSON schema dict, "
                   f"not {type(schema).__name__}")


def answered(call: Request, reply: ModelReply, data: Any, offline: bool,
             replayed: bool = False) -> Completion:
    """What the agent gets for an answered (or ``replayed``) call."""
    return Completion(
        text=reply.text, data=data, prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens, cost_usd=call.cost, route=call.route.route,
        model=call.route.model, backend=reply.backend, offline=offline or reply.offline,
        route_reason=call.route.reason, duration_seconds=reply.duration_seconds,
        call_index=call.call_index, position=call.position, attempts=call.rows,
        replayed=replayed, thinking=reply.thinking, tool_calls=reply.tool_calls)
