"""One model call's pieces: the answer agents see, its identity, its record, its checks.

Pure helpers of :mod:`runtime.llm.handle` (no I/O): :class:`Completion` (what
``ctx.llm.complete`` returns), :func:`request_hash` (a durable call's identity),
:class:`Call` (one logical call in flight), and the checks of a request's schema and a
reply's shape.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from runtime.config import Settings
from runtime.errors import BadInput, TransientModelError, UnknownPrice
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.ledger import RecordedCall
from runtime.llm.reply import (
    Backend,
    BadModelReply,
    Message,
    ModelReply,
    ToolCall,
    parse_structured,
    request_text,
)
from runtime.llm.routing import Route
from runtime.llm.tool_loop import ToolOutcome, ToolRound, recorded_tool_calls, round_note
from runtime.store.rows import ModelCharge

#: The longest ``Retry-After`` honoured as given (longer ones are cut to this).
MAX_RETRY_AFTER_SECONDS = 300.0


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


#: ``json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)``, the encoder
#: made once (``json.dumps`` with options builds one per call).
_canonical = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str).encode


def request_hashes(models: Sequence[str], messages: list[Message],
                   schema: dict[str, Any] | None, max_tokens: int, think: bool,
                   tools: list[dict[str, Any]] | None = None) -> dict[str, str]:
    """:func:`request_hash` of one request for each of ``models``, serialised once.

    The canonical JSON's keys are sorted (``messages``, ``model``, ``options``,
    ``schema``, ``tools``), so the text around the model is the same for every model:
    it is built once and each model's hash is the same bytes :func:`request_hash` hashes.
    """
    head = '{"messages":' + _canonical(messages) + ',"model":'
    tail = (',"options":{"num_predict":' + _canonical(max_tokens)
            + (',"think":true}' if think else ',"think":false}')
            + ',"schema":' + ("null" if schema is None else _canonical(schema))
            + (',"tools":' + _canonical(tools) if tools else "") + "}")
    return {model: hashlib.sha256((head + _canonical(model) + tail).encode()).hexdigest()
            for model in models}


def request_hash(model: str, messages: list[Message], schema: dict[str, Any] | None,
                 max_tokens: int, think: bool,
                 tools: list[dict[str, Any]] | None = None) -> str:
    """sha256 of a request's canonical JSON: model, messages, schema, tools and options.

    ``max_tokens`` is what the agent asked (not what the budget left), so the same call
    hashes the same on every delivery. ``tools`` count only when given.
    """
    body = {"model": model, "messages": messages, "schema": schema,
            "options": {"num_predict": max_tokens, "think": think}}
    if tools:
        body["tools"] = tools
    return hashlib.sha256(_canonical(body).encode()).hexdigest()


@dataclass
class Call:
    """One logical call in flight: its identity, route and the attempts made so far."""

    position: str
    call_index: int
    request_hash: str
    stored_prompt: str
    route: Route
    price: Decimal
    rows: int = 0
    cost: Decimal = field(default_factory=lambda: Decimal(0))
    #: The tools offered (a round of a tool loop), and the kind of its first request
    #: (``repair`` after a round whose tool arguments were bad).
    tools: list[dict[str, Any]] = field(default_factory=list)
    first_kind: str = "call"


@dataclass(frozen=True)
class Rows:
    """Whose ``model_calls`` rows a task's requests are: builds each row to charge."""

    task_id: uuid.UUID
    lease_token: uuid.UUID
    attempt: int
    backend: str
    phase: str
    record: bool

    def row(self, call: Call, kind: str, reply: ModelReply | None, prompt_tokens: int,
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

    def replayed(self, call: Call, reply: ModelReply) -> ModelCharge:
        """The zero-cost ``replayed`` row of a call served from the record."""
        return replace(self.row(call, "call", reply, 0, 0, 0.0, Decimal(0), None),
                       replayed=True, call_try=0)


def replay_record(rows: Rows, call: Call, reply: ModelReply,
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

    def __init__(self, ledger: Any, lease_lost: Any) -> None:
        self._ledger = ledger
        self._lease_lost = lease_lost
        self._held: list[tuple[Rows, Call, ModelReply, dt.datetime]] | None = None

    def defer(self) -> None:
        """From now on, hold the rows (:meth:`hold`) instead of writing them at once."""
        if self._held is None:
            self._held = []

    def hold(self, rows: Rows, call: Call, reply: ModelReply) -> bool:
        """Hold one replayed call's row; False when rows are not held (the caller writes it).

        Only what the row is made of is kept (the row is built by :func:`held_replays`).
        """
        if self._held is None:
            return False
        self._held.append((rows, call, reply, dt.datetime.now(dt.UTC)))
        return True

    def take(self) -> list[tuple[Rows, Call, ModelReply, dt.datetime]]:
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


def error_name(exc: BaseException) -> str:
    """The error's class as recorded: a retryable error is recorded as transient."""
    return "TransientModelError" if isinstance(exc, TransientModelError) else type(exc).__name__


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


def validated(reply: ModelReply, model_cls: type[BaseModel] | None) -> Any:
    """The reply's data, validated by ``model_cls`` (``BadModelReply`` if it does not fit)."""
    if model_cls is None or reply.data is None:
        return reply.data
    try:
        return model_cls.model_validate(reply.data).model_dump(mode="json")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise BadModelReply(
            f"the reply of model {reply.model!r} does not fit {model_cls.__name__} at "
            f"{where}: {first['msg']}", reply) from None


def price_of(settings: Settings, route: Route) -> Decimal:
    """The routed model's price per token; ``UnknownPrice`` when it has none."""
    price = settings.cost.price_for(route.route, route.model)
    if price is None:
        raise UnknownPrice(
            f"model {route.model!r} (route {route.route}) has no price: set "
            f"cost.{route.route}_per_token, or a price for {route.model!r} in cost.prices, "
            "in orgchart.toml")
    return price


def answered(call: Call, reply: ModelReply, data: Any, offline: bool,
             replayed: bool = False) -> Completion:
    """What the agent gets for an answered (or ``replayed``) call."""
    return Completion(
        text=reply.text, data=data, prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens, cost_usd=call.cost, route=call.route.route,
        model=call.route.model, backend=reply.backend, offline=offline or reply.offline,
        route_reason=call.route.reason, duration_seconds=reply.duration_seconds,
        call_index=call.call_index, position=call.position, attempts=call.rows,
        replayed=replayed, thinking=reply.thinking, tool_calls=reply.tool_calls)


def replay_of(recorded: RecordedCall, prompt: str, system: str | None,
              json_schema: dict[str, Any] | None, model_cls: type[BaseModel] | None,
              call_index: int, position: str,
              tools: ToolRound | None = None) -> tuple[Call, ModelReply] | None:
    """A recorded reply as a call and its reply (no request made); None if it is unusable."""
    data = None
    calls = recorded_tool_calls(recorded.tool_calls)
    if json_schema and not calls:
        try:
            data = parse_structured(recorded.response, json_schema, recorded.model)
            if model_cls is not None:
                data = model_cls.model_validate(data).model_dump(mode="json")
        except (BadModelReply, ValidationError):
            return None
    route = Route("cloud" if recorded.route == "cloud" else "local", recorded.model,
                  f"replayed from model call {recorded.call_id}")
    call = Call(position, call_index, recorded.request_hash,
                request_text(prompt, system, json_schema) + round_note(tools), route,
                Decimal(0))
    reply = ModelReply(recorded.response, data, 0, 0, 0.0, recorded.model, recorded.backend,
                       offline=recorded.backend == OfflineBackend.name,
                       thinking=recorded.thinking, tool_calls=calls)
    return call, reply


@dataclass
class Retries:
    """One call's retries of transient failures (``[llm]`` settings).

    Backoff with full jitter, a server's ``Retry-After`` honoured (up to
    :data:`MAX_RETRY_AFTER_SECONDS`), and a busy server's 503s waited out for up to
    ``busy_wait_seconds`` without spending a retry.
    """

    llm: Any
    spent: int = 0
    busy_waited: float = 0.0

    def delay(self, exc: TransientModelError, requests: int) -> float:
        """Seconds to wait before the next request; raises when the retries are spent."""
        llm = self.llm
        retry_after = getattr(exc, "retry_after", None)
        if retry_after is not None:
            delay = min(float(retry_after), MAX_RETRY_AFTER_SECONDS)
        else:
            ceiling = min(llm.retry_max_seconds, llm.retry_base_seconds * 2 ** self.spent)
            delay = random.uniform(0, ceiling)
        if getattr(exc, "status", None) == 503 and \
                self.busy_waited + delay <= llm.busy_wait_seconds:
            self.busy_waited += delay  # a busy server: wait our turn, keep the retries
        elif self.spent < llm.call_retries:
            self.spent += 1
        else:
            raise TransientModelError(
                f"{exc} (gave up after {requests} request(s) in this call; "
                f"llm.call_retries = {llm.call_retries})") from exc
        return delay
