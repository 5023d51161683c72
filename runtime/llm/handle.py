"""The model layer agents use: ``ctx.llm.acomplete(...)`` / ``complete(...)``, per task.

:class:`LLMFactory` builds the backend once per process (``[llm] backend``; ``auto`` says
which it chose in :attr:`LLMFactory.announcement`), and hands each leased task a
:class:`TaskLLM`. One call (:meth:`TaskLLM.acomplete`, on the caller's loop;
:meth:`TaskLLM.complete` submits it to the worker's loop, or the model layer's own, and
waits):

1. refuses when the task's lease is lost (:class:`~runtime.errors.LeaseLost`);
2. takes its identity: the task, its phase (run, aggregate, judge), its position (order
   of issue, or ``key=``) and a sha256 of the request (model, messages, schema, options).
   When the record holds a successful reply for that identity (an earlier delivery made
   the call), the reply is returned at once, charged zero, and a row marked ``replayed``
   is written (``[llm] durable``);
3. routes the prompt (:func:`runtime.llm.routing.decide_route`) and prices the model
   (``[cost]``); no price -> :class:`~runtime.errors.UnknownPrice`;
4. checks the budget before each request: spent + estimated prompt tokens + ``max_tokens``
   must fit ``budget_tokens`` and ``budget_usd`` (``max_tokens`` shrinks to what is left;
   below :data:`MIN_COMPLETION_TOKENS` -> :class:`~runtime.errors.BudgetExceeded`);
5. sends it, at most ``[ollama] max_parallel`` at once per server and model, once the
   start gate (:mod:`runtime.llm.gate`) says its task is not cancelled nor paused; transient
   failures are retried in the call (``[llm] call_retries``, backoff with full jitter,
   ``Retry-After`` honoured, a 503 waits its turn); a bad structured reply is asked again
   with its error appended to the conversation (``[llm] output_retries``);
6. records every attempt as a ``model_calls`` row (its error, its tokens, its kind:
   ``call``, ``retry`` or ``repair``) and charges it through the ledger
   (:class:`~runtime.llm.ledger.CallLedger`): the task's own spend and the row, nothing
   above it (spend rolls up to the parent when the task ends).

Cost is ``(prompt + completion tokens) x the per-token price``, in ``Decimal``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from agents.tasks import DEFAULT_BUDGET_TOKENS, DEFAULT_BUDGET_USD
from runtime.config import Settings
from runtime.errors import BadInput, BudgetExceeded, LeaseLost, TransientModelError, UnknownPrice
from runtime.llm.backends.choice import build_backend
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.gate import CallGate
from runtime.llm.ledger import CallLedger, RecordedCall
from runtime.llm.loop import CallLoop
from runtime.llm.reply import (
    NOT_RECORDED,
    Backend,
    BadModelReply,
    Message,
    ModelReply,
    estimate_tokens,
    first_messages,
    parse_structured,
    request_key,
    request_text,
)
from runtime.llm.routing import Route, decide_route
from runtime.llm.steps import TaskSteps
from runtime.store.rows import ModelCharge

T = TypeVar("T")


log = logging.getLogger(__name__)

#: A call is refused when fewer completion tokens than this (or than asked) fit the budget.
MIN_COMPLETION_TOKENS = 16
#: Costs are kept to the precision of the database's money columns.
USD_QUANTUM = Decimal("0.00000001")
#: How much of a bad reply a repair sends back to the model.
MAX_REPAIR_ECHO_CHARS = 2000
#: Threads for the ledger's blocking reads (record look-ups, queue depth).
LEDGER_THREADS = 32
#: How long one read of the pending queue's depth serves routing decisions.
DEPTH_TTL_SECONDS = 0.5
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


def request_hash(model: str, messages: list[Message], schema: dict[str, Any] | None,
                 max_tokens: int, think: bool) -> str:
    """sha256 of a request's canonical JSON: model, messages, schema and options.

    ``max_tokens`` is what the agent asked (not what the budget left), so the same call
    hashes the same on every delivery.
    """
    body = {"model": model, "messages": messages, "schema": schema,
            "options": {"num_predict": max_tokens, "think": think}}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class LLMFactory:
    """Builds the backend once and gives each leased task its :class:`TaskLLM`.

    Args:
        settings: the configuration.
        ledger: the database side (:class:`~runtime.llm.ledger.CallLedger`).
        backend: a backend to use instead of the one ``[llm] backend`` names.
        announcement: the sentence to announce with ``backend``.

    Attributes:
        backend: the backend every task shares.
        offline: True for the offline backend, and for a replay of a run recorded offline.
        announcement: one sentence saying which backend was chosen and why.

    """

    def __init__(self, settings: Settings, ledger: CallLedger, backend: Backend | None = None,
                 announcement: str | None = None) -> None:
        if backend is None:
            backend, announcement = build_backend(settings)
        self.settings = settings
        self.ledger = ledger
        self.backend: Backend = backend
        self.offline = _is_offline(backend)
        self.announcement = announcement or f"using the {backend.name} backend"
        self.calls = CallLoop()
        #: The start gate of every request: cancelled tasks and paused trees (gate.py).
        self.gate = CallGate(getattr(ledger, "gate_calls", None), self.in_ledger)
        # The ledger's blocking reads run here, not in asyncio's default executor (a few
        # threads per core): a thousand calls in flight each look up their record.
        self._ledger_pool = ThreadPoolExecutor(max_workers=LEDGER_THREADS,
                                               thread_name_prefix="llm-ledger")
        self._depth: tuple[float, int] | None = None
        self._depth_reads: dict[asyncio.AbstractEventLoop, asyncio.Future[int]] = {}

    async def in_ledger(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one blocking ledger call off the loop, in the factory's ledger threads."""
        return await asyncio.get_running_loop().run_in_executor(self._ledger_pool, fn, *args)

    async def pending_depth(self) -> int:
        """The pending queue's depth for routing, read at most once per TTL.

        Routing needs its order of magnitude; a thousand calls in flight must not each
        count the queue, nor each wait for a thread (:data:`DEPTH_TTL_SECONDS`; one read
        in flight per loop, shared by the callers that arrive meanwhile).
        """
        cached = self._depth
        if cached is not None and time.monotonic() - cached[0] < DEPTH_TTL_SECONDS:
            return cached[1]
        loop = asyncio.get_running_loop()
        reading = self._depth_reads.get(loop)
        if reading is None:  # one read in flight per loop; the other callers share it
            reading = asyncio.ensure_future(self.in_ledger(self.ledger.pending_depth))
            self._depth_reads[loop] = reading
            reading.add_done_callback(lambda _: self._depth_reads.pop(loop, None))
        depth = await asyncio.shield(reading)
        self._depth = (time.monotonic(), depth)
        return depth

    async def charge(self, charge: ModelCharge) -> bool:
        """Charge one call through the ledger (awaited without a thread when it can be)."""
        acharge = getattr(self.ledger, "acharge", None)
        if acharge is not None:
            return bool(await acharge(charge))
        return await self.in_ledger(self.ledger.charge, charge)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make sync callers' calls on ``loop`` (a worker's, while it runs)."""
        self.calls.attach(loop)

    async def detach(self) -> None:
        """From a coroutine on an attached loop about to close: close its connections."""
        await self.aclose()
        self.calls.detach(asyncio.get_running_loop())

    def for_task(self, task_row: dict[str, Any], lease_token: uuid.UUID,
                 lease_lost: threading.Event) -> TaskLLM:
        """Return the model handle for one leased task (``ctx.llm``)."""
        return TaskLLM(self, task_row, lease_token, lease_lost)

    def slot(self, route: Route) -> asyncio.Semaphore:
        """The semaphore bounding calls in flight to this route's server and model."""
        host_for = getattr(self.backend, "host_for", None)
        host = host_for(route.route) if host_for is not None else self.backend.name
        o = self.settings.ollama
        limit = o.cloud_max_parallel if route.route == "cloud" else o.max_parallel
        return self.calls.slot(host, route.model, limit)

    async def aclose(self) -> None:
        """Release the backend's connections made on the running loop."""
        aclose = getattr(self.backend, "aclose", None)
        if aclose is not None:
            await aclose()

    def close(self) -> None:
        """Release the backend's connections and stop the factory's own loop.

        A worker that attached its loop awaits :meth:`detach` before the loop ends.
        """
        aclose = getattr(self.backend, "aclose", None)
        self.calls.close(aclose() if aclose is not None else None)
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()
        self._ledger_pool.shutdown(wait=False)


@dataclass
class _Call:
    """One logical call in flight: its identity, route and the attempts made so far."""

    position: str
    call_index: int
    request_hash: str
    stored_prompt: str
    route: Route
    price: Decimal
    rows: int = 0
    cost: Decimal = field(default_factory=lambda: Decimal(0))


class TaskLLM:
    """Budget-aware model calls for one leased task; every attempt is recorded and charged."""

    def __init__(self, factory: LLMFactory, task_row: dict[str, Any], lease_token: uuid.UUID,
                 lease_lost: threading.Event) -> None:
        self._factory = factory
        self._settings = factory.settings
        self._ledger = factory.ledger
        self._backend = factory.backend
        self._lease_token = lease_token
        self._lease_lost = lease_lost
        self.task_id: uuid.UUID = task_row["id"]
        self.phase = ("judge" if task_row.get("status") == "judging"
                      else str(task_row.get("phase") or "run"))
        self._attempt = int(task_row.get("delivery_count") or 1)
        # The claim says whether replies of this phase are on record; when none are, no
        # call of this delivery looks one up (until this delivery records one itself).
        self._may_replay = bool(task_row.get("recorded_calls", True))
        # A fork's branch task: its counterpart's record answers the calls it repeats, and
        # the fork may have set the model of its calls (docs/writing-agents.md).
        self._counterpart: uuid.UUID | None = task_row.get("forked_from")
        self._model_override: str | None = task_row.get("model_override")
        if self._counterpart is not None:
            self._may_replay = True
        budget_tokens = task_row.get("budget_tokens")
        budget_usd = task_row.get("budget_usd")
        self.budget_tokens = int(DEFAULT_BUDGET_TOKENS if budget_tokens is None
                                 else budget_tokens)
        self.budget_usd = Decimal(DEFAULT_BUDGET_USD if budget_usd is None else budget_usd)
        self._spent_tokens = int(task_row.get("spent_tokens") or 0)
        self._spent_usd = Decimal(task_row.get("spent_usd") or 0)
        self._reserved_tokens = 0
        self._reserved_usd = Decimal(0)
        self._calls = 0
        self._lock = threading.Lock()
        self.offline = _is_offline(self._backend)
        #: The task's durable steps (``ctx.step``), recorded through the same ledger.
        self.steps = TaskSteps(factory.ledger, task_row, lease_token, lease_lost,  # type: ignore[arg-type]
                               in_ledger=factory.in_ledger)

    # ------------------------------------------------------------------ budget
    def remaining_tokens(self) -> int:
        """Tokens the task's subtree may still spend."""
        with self._lock:
            return max(0, self.budget_tokens - self._spent_tokens)

    def remaining_usd(self) -> Decimal:
        """USD the task's subtree may still spend."""
        with self._lock:
            return max(Decimal(0), self.budget_usd - self._spent_usd)

    def _allowed_completion(self, prompt_estimate: int, price: Decimal, asked: int) -> int:
        """Completion tokens this request may use; raises BudgetExceeded when too few remain."""
        spent_tokens = self._spent_tokens + self._reserved_tokens
        spent_usd = self._spent_usd + self._reserved_usd
        token_room = self.budget_tokens - spent_tokens - prompt_estimate
        usd_room = (math.floor((self.budget_usd - spent_usd) / price) - prompt_estimate
                    if price > 0 else asked)
        allowed = min(asked, token_room, usd_room)
        needed = min(MIN_COMPLETION_TOKENS, asked)
        if allowed >= needed:
            return allowed
        problems = []
        if token_room < needed:
            problems.append(
                f"it needs about {prompt_estimate} prompt + {needed} completion tokens but "
                f"{max(0, self.budget_tokens - spent_tokens)} of budget_tokens "
                f"{self.budget_tokens} are left (spent {spent_tokens})")
        if usd_room < needed:
            cost = ((prompt_estimate + needed) * price).quantize(USD_QUANTUM)
            problems.append(
                f"it would cost about ${cost} at ${price}/token but "
                f"${max(Decimal(0), self.budget_usd - spent_usd)} of budget_usd "
                f"${self.budget_usd} is left (spent ${spent_usd})")
        raise BudgetExceeded(f"budget: model call refused for task {self.task_id}: "
                             + "; ".join(problems))

    # ------------------------------------------------------------------ the call
    def complete(self, prompt: str, *, schema: type[BaseModel] | dict[str, Any] | None = None,
                 system: str | None = None, max_tokens: int | None = None,
                 key: str | None = None) -> Completion:
        """Call the model from synchronous code: :meth:`acomplete` run on the factory's loop.

        Takes the same arguments and raises the same errors as :meth:`acomplete`. Do not
        call it from a coroutine running on the factory's loop: await :meth:`acomplete`.
        """
        return self._factory.calls.run(self.acomplete(prompt, schema=schema, system=system,
                                                      max_tokens=max_tokens, key=key))

    async def acomplete(self, prompt: str, *,
                        schema: type[BaseModel] | dict[str, Any] | None = None,
                        system: str | None = None, max_tokens: int | None = None,
                        key: str | None = None) -> Completion:
        """Call the model for this task, within its budget, and charge the call.

        Parallel calls in one task: ``await asyncio.gather(llm.acomplete(a),
        llm.acomplete(b))``; each takes its position in the order it was issued.

        Args:
            prompt: the user prompt.
            schema: a pydantic model class or a JSON schema dict for structured output.
            system: an optional system prompt.
            max_tokens: completion tokens at most (default ``[ollama] num_predict``);
                shrunk to what the budget leaves.
            key: the call's position in the task instead of its order of issue (unique
                within the task's phase); use it when the order of calls is not stable.

        Raises:
            LeaseLost: the task was taken away (before the call, or found at charge time).
            UnknownPrice: the routed model has no price (a policy violation).
            BudgetExceeded: the call would overrun the budget; nothing was spent.
            TransientModelError: the model server stayed unreachable, busy or slow through
                ``[llm] call_retries`` retries.
            ModelNotFound: the server lacks the routed model.
            BadModelReply: no reply fit the schema in 1 + ``[llm] output_retries`` attempts.
            ReplayMiss: replaying, and the request was never recorded.
            BadInput: the arguments themselves are wrong.

        """
        if self._lease_lost.is_set():
            raise LeaseLost(f"task {self.task_id}: lease lost; the model was not called")
        json_schema, model_cls = _schema_of(schema)
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadInput("complete() needs a non-empty prompt string")
        if key is not None and (not isinstance(key, str) or not key.strip()):
            raise BadInput("key= must be a non-empty string")
        asked = self._settings.ollama.num_predict if max_tokens is None else int(max_tokens)
        if asked < 1:
            raise BadInput(f"max_tokens must be at least 1 (got {max_tokens})")
        with self._lock:  # before any await: positions follow the order of issue
            call_index = self._calls
            self._calls += 1
        position = f"key:{key}" if key is not None else str(call_index)
        return await self._call(
            prompt, system, json_schema, model_cls, asked, call_index, position)

    async def _call(self, prompt: str, system: str | None, json_schema: dict[str, Any] | None,
                    model_cls: type[BaseModel] | None, asked: int, call_index: int,
                    position: str) -> Completion:
        settings = self._settings
        think = settings.ollama.think
        messages = first_messages(prompt, system)
        hashes: dict[str, str] = {}
        if settings.llm.durable and settings.llm.record and self._may_replay:
            # Either route may have answered before: look for a reply to either model.
            models = ((self._model_override,) if self._model_override
                      else (settings.models.local, settings.models.cloud))
            hashes = {model: request_hash(model, messages, json_schema, asked, think)
                      for model in models}
            lookup: tuple[Any, ...] = (self.task_id, self.phase, position,
                                       sorted(set(hashes.values())))
            if self._counterpart is not None:
                lookup = (*lookup, self._counterpart)
            recorded = await self._factory.in_ledger(self._ledger.recorded_call, *lookup)
            if recorded is not None:
                replayed = await self._replayed(recorded, prompt, system, json_schema,
                                                model_cls, call_index, position)
                if replayed is not None:
                    return replayed
        depth = await self._factory.pending_depth()
        route = decide_route(prompt, depth, settings)
        if self._model_override:
            route = Route(route.route, self._model_override,
                          f"{route.reason}; model {self._model_override} set by a fork")
        price = settings.cost.price_for(route.route, route.model)
        if price is None:
            raise UnknownPrice(
                f"model {route.model!r} (route {route.route}) has no price: set "
                f"cost.{route.route}_per_token, or a price for {route.model!r} in cost.prices, "
                "in orgchart.toml"
            )
        digest = hashes.get(route.model) or request_hash(route.model, messages, json_schema,
                                                         asked, think)
        stored_prompt = (request_text(prompt, system, json_schema) if settings.llm.record
                         else f"{NOT_RECORDED} request {request_key(prompt, system, json_schema)}")
        call = _Call(position, call_index, digest, stored_prompt, route, price)
        reply, data = await self._with_repairs(call, messages, json_schema, model_cls, asked,
                                               think)
        self._may_replay = True  # this reply is on record now (a repeated key replays it)
        return Completion(
            text=reply.text, data=data, prompt_tokens=reply.prompt_tokens,
            completion_tokens=reply.completion_tokens, cost_usd=call.cost, route=route.route,
            model=route.model, backend=reply.backend, offline=self.offline or reply.offline,
            route_reason=route.reason, duration_seconds=reply.duration_seconds,
            call_index=call_index, position=position, attempts=call.rows,
            thinking=reply.thinking)

    async def _with_repairs(self, call: _Call, messages: list[Message],
                            json_schema: dict[str, Any] | None,
                            model_cls: type[BaseModel] | None, asked: int,
                            think: bool) -> tuple[ModelReply, Any]:
        """Ask, and ask again with the error while a structured reply is bad."""
        conversation = list(messages)
        rounds = 1 + (self._settings.llm.output_retries if json_schema else 0)
        errors: list[str] = []
        for number in range(rounds):
            kind = "call" if number == 0 else "repair"
            try:
                return await self._with_retries(call, conversation, json_schema, model_cls,
                                                asked, think, kind)
            except BadModelReply as exc:
                errors.append(str(exc))
                bad = exc.reply.text if exc.reply is not None else ""
                # Only the first request and the latest failure: a repair's prompt does not
                # grow with every attempt (it is paid for, and must fit the budget).
                conversation = [*messages,
                                {"role": "assistant", "content": bad[:MAX_REPAIR_ECHO_CHARS]},
                                {"role": "user", "content": (
                                    f"Your reply failed: {exc.reason[:300]}. Answer again "
                                    "with only JSON that fits the schema.")}]
        raise BadModelReply(
            f"model {call.route.model!r} gave no reply that fits the schema in {rounds} "
            f"attempt(s) ({call.rows} request(s)); last error: {errors[-1]}")

    async def _with_retries(self, call: _Call, conversation: list[Message],
                            json_schema: dict[str, Any] | None,
                            model_cls: type[BaseModel] | None, asked: int, think: bool,
                            kind: str) -> tuple[ModelReply, Any]:
        """Send, retrying transient failures with backoff; ``Retry-After`` and 503 waits."""
        llm = self._settings.llm
        spent = 0
        busy_waited = 0.0
        while True:
            try:
                return await self._request(call, conversation, json_schema, model_cls, asked,
                                           think, kind)
            except TransientModelError as exc:
                status = getattr(exc, "status", None)
                retry_after = getattr(exc, "retry_after", None)
                if retry_after is not None:
                    delay = min(float(retry_after), MAX_RETRY_AFTER_SECONDS)
                else:
                    ceiling = min(llm.retry_max_seconds, llm.retry_base_seconds * 2 ** spent)
                    delay = random.uniform(0, ceiling)
                if status == 503 and busy_waited + delay <= llm.busy_wait_seconds:
                    busy_waited += delay  # a busy server: wait our turn, keep the retries
                elif spent < llm.call_retries:
                    spent += 1
                else:
                    raise TransientModelError(
                        f"{exc} (gave up after {call.rows} request(s) in this call; "
                        f"llm.call_retries = {llm.call_retries})") from exc
                kind = "retry"
                await asyncio.sleep(delay)
                if self._lease_lost.is_set():
                    raise LeaseLost(f"task {self.task_id}: lease lost while the model call "
                                    "waited to retry") from exc

    async def _request(self, call: _Call, conversation: list[Message],
                       json_schema: dict[str, Any] | None, model_cls: type[BaseModel] | None,
                       asked: int, think: bool, kind: str) -> tuple[ModelReply, Any]:
        """One request: budget check, send, check the reply, record and charge it."""
        if self._lease_lost.is_set():
            raise LeaseLost(f"task {self.task_id}: lease lost; the model was not called")
        route, price = call.route, call.price
        estimate = sum(estimate_tokens(m.get("content")) for m in conversation)
        with self._lock:
            allowed = self._allowed_completion(estimate, price, asked)
            reserved_tokens = estimate + allowed
            reserved_usd = reserved_tokens * price
            self._reserved_tokens += reserved_tokens
            self._reserved_usd += reserved_usd
        call.rows += 1
        started = time.monotonic()
        charged_tokens, charged_usd = 0, Decimal(0)
        try:
            try:
                reply = await self._factory.gate.send(  # cancelled? paused? (gate.py)
                    self.task_id, self._factory.slot(route),
                    lambda: self._backend.achat(route.model, conversation, json_schema,
                                                allowed, route=route.route, think=think))
                data = _validated(reply, model_cls)
            except Exception as exc:
                spent = exc.reply if isinstance(exc, BadModelReply) else None
                charged_tokens, charged_usd = await self._record_failure(
                    exc, spent, call, kind, time.monotonic() - started)
                raise
            tokens = reply.prompt_tokens + reply.completion_tokens
            cost = (tokens * price).quantize(USD_QUANTUM)
            await self._charge(self._row(call, kind, reply, reply.prompt_tokens,
                                         reply.completion_tokens, reply.duration_seconds,
                                         cost, None))
            charged_tokens, charged_usd = tokens, cost
            call.cost += cost
            return reply, data
        finally:
            with self._lock:
                self._reserved_tokens -= reserved_tokens
                self._reserved_usd -= reserved_usd
                self._spent_tokens += charged_tokens
                self._spent_usd += charged_usd

    def _row(self, call: _Call, kind: str, reply: ModelReply | None, prompt_tokens: int,
             completion_tokens: int, duration: float, cost: Decimal,
             error: str | None) -> ModelCharge:
        record = self._settings.llm.record
        return ModelCharge(
            task_id=self.task_id, lease_token=self._lease_token, attempt=self._attempt,
            call_index=call.call_index,
            backend=reply.backend if reply is not None else self._backend.name,
            route=call.route.route, route_reason=call.route.reason, model=call.route.model,
            prompt=call.stored_prompt,
            response=reply.text if reply is not None and record else None,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            duration_seconds=duration, cost_usd=cost, error=error, phase=self.phase,
            position=call.position, request_hash=call.request_hash, attempt_kind=kind,
            call_try=call.rows,
            thinking=reply.thinking if reply is not None and record else None)

    async def _charge(self, charge: ModelCharge) -> None:
        if not await self._factory.charge(charge):
            raise LeaseLost(f"task {self.task_id}: lease lost; the model call was not charged "
                            "and its answer is dropped")

    async def _record_failure(self, exc: Exception, reply: ModelReply | None, call: _Call,
                              kind: str, duration: float) -> tuple[int, Decimal]:
        """Record a failed request (with the tokens it used, if any); return what was charged.

        A lost lease found here wins over the call's own error: the worker must drop the
        task rather than retry or fail it.
        """
        if isinstance(exc, (LeaseLost, BudgetExceeded, asyncio.CancelledError)):
            return 0, Decimal(0)
        prompt_tokens = reply.prompt_tokens if reply else 0
        completion_tokens = reply.completion_tokens if reply else 0
        cost = ((prompt_tokens + completion_tokens) * call.price).quantize(USD_QUANTUM)
        charge = self._row(call, kind, reply, prompt_tokens, completion_tokens, duration,
                           cost, f"{_error_name(exc)}: {exc}")
        try:
            applied = await self._factory.charge(charge)
        except Exception:  # never hide the call's own error behind a recording error
            log.exception("could not record a failed model call",
                          extra={"task_id": str(self.task_id)})
            return 0, Decimal(0)
        if not applied:
            raise LeaseLost(f"task {self.task_id}: lease lost during a failed model call "
                            f"({exc})") from exc
        call.cost += cost
        return prompt_tokens + completion_tokens, cost

    async def _replayed(self, recorded: RecordedCall, prompt: str, system: str | None,
                        json_schema: dict[str, Any] | None, model_cls: type[BaseModel] | None,
                        call_index: int, position: str) -> Completion | None:
        """Serve a recorded reply (charged zero, a ``replayed`` row); None if it is unusable."""
        data = None
        if json_schema:
            try:
                data = parse_structured(recorded.response, json_schema, recorded.model)
                if model_cls is not None:
                    data = model_cls.model_validate(data).model_dump(mode="json")
            except (BadModelReply, ValidationError):
                return None
        route = Route("cloud" if recorded.route == "cloud" else "local", recorded.model,
                      f"replayed from model call {recorded.call_id}")
        call = _Call(position, call_index, recorded.request_hash,
                     request_text(prompt, system, json_schema), route, Decimal(0))
        reply = ModelReply(recorded.response, data, 0, 0, 0.0, recorded.model,
                           recorded.backend, offline=recorded.backend == OfflineBackend.name,
                           thinking=recorded.thinking)
        charge = self._row(call, "call", reply, 0, 0, 0.0, Decimal(0), None)
        await self._charge(dataclasses.replace(charge, replayed=True, call_try=0))
        return Completion(
            text=recorded.response, data=data, prompt_tokens=0, completion_tokens=0,
            cost_usd=Decimal(0), route=route.route, model=recorded.model,
            backend=recorded.backend, offline=self.offline or reply.offline,
            route_reason=route.reason, call_index=call_index, position=position, attempts=0,
            replayed=True, thinking=recorded.thinking)


def _error_name(exc: BaseException) -> str:
    """The error's class as recorded: a retryable error is recorded as transient."""
    return "TransientModelError" if isinstance(exc, TransientModelError) else type(exc).__name__


def _is_offline(backend: Backend) -> bool:
    """Offline backend, or a replay of a run that was recorded offline."""
    return backend.name == OfflineBackend.name or bool(getattr(backend, "offline", False))


def _schema_of(schema: Any) -> tuple[dict[str, Any] | None, type[BaseModel] | None]:
    if schema is None:
        return None, None
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema.model_json_schema(), schema
    if isinstance(schema, dict):
        return schema, None
    raise BadInput(f"schema must be a pydantic model class or a JSON schema dict, "
                   f"not {type(schema).__name__}")


def _validated(reply: ModelReply, model_cls: type[BaseModel] | None) -> Any:
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

