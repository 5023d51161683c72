"""The model layer agents use: ``ctx.llm.complete(...)``, bound to one task and its budget.

:class:`LLMFactory` builds the backend once per process (``[llm] backend``; ``auto`` says
which it chose in :attr:`LLMFactory.announcement`) and hands each leased task a
:class:`TaskLLM`. One ``complete`` call:

1. refuses when the task's lease is lost (:class:`~runtime.errors.LeaseLost`);
2. routes the prompt (:func:`runtime.llm.routing.decide_route`: long prompt or deep queue ->
   cloud model, else local);
3. prices the route's model (``[cost]``); no price -> :class:`~runtime.errors.UnknownPrice`;
4. checks the budget before spending: the task's budget covers its whole subtree, so the
   call is allowed only if spent + estimated prompt tokens + ``max_tokens`` fit in
   ``budget_tokens`` (and likewise in ``budget_usd``). ``max_tokens`` shrinks to what is
   left; when not even :data:`MIN_COMPLETION_TOKENS` are left the call raises
   :class:`~runtime.errors.BudgetExceeded` and nothing is spent;
5. calls the backend and records the call (prompt, response, tokens, cost, duration) with
   ``store.charge``, which also adds the cost to the task and every ancestor. Failed calls
   are recorded too, with their error and the tokens they used.

Cost is ``(prompt + completion tokens) x the per-token price``, in ``Decimal``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ValidationError

from runtime.config import Settings
from runtime.errors import BadInput, BudgetExceeded, LeaseLost, UnknownPrice
from runtime.llm.backends import (
    NOT_RECORDED,
    Backend,
    BackendConfigError,
    BadModelReply,
    ModelReply,
    ModelRequestError,
    OfflineBackend,
    OllamaBackend,
    ReplayBackend,
    ReplayMiss,
    build_backend,
    estimate_tokens,
    request_key,
    request_text,
)
from runtime.llm.routing import Route, decide_route
from runtime.store.rows import ModelCharge
from runtime.store.store import Store

__all__ = [
    "MIN_COMPLETION_TOKENS",
    "Backend",
    "BackendConfigError",
    "BadModelReply",
    "Completion",
    "LLMFactory",
    "ModelReply",
    "ModelRequestError",
    "OfflineBackend",
    "OllamaBackend",
    "ReplayBackend",
    "ReplayMiss",
    "Route",
    "TaskLLM",
    "build_backend",
    "decide_route",
]

log = logging.getLogger(__name__)

#: A call is refused when fewer completion tokens than this (or than asked) fit the budget.
MIN_COMPLETION_TOKENS = 16
#: Costs are kept to the precision of the database's money columns.
USD_QUANTUM = Decimal("0.00000001")

DEFAULT_BUDGET_TOKENS = 50_000
DEFAULT_BUDGET_USD = Decimal("1.0")


@dataclass(frozen=True)
class Completion:
    """One answered model call, as an agent sees it.

    Attributes:
        text: the reply text (JSON text for structured output).
        data: the parsed reply when a schema was given (a JSON-ready dict for a pydantic
            model, validated by it), else None.
        prompt_tokens / completion_tokens: tokens charged.
        cost_usd: what the call cost.
        route / model / route_reason: where the call went and why.
        backend: ``ollama``, ``offline`` or ``replay``.
        offline: True when the answer came from the offline backend (not a model's work),
            directly or replayed from a run recorded offline.

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


class LLMFactory:
    """Builds the backend once and gives each leased task its :class:`TaskLLM`.

    Attributes:
        backend: the backend every task shares.
        offline: True for the offline backend, and for a replay of a run recorded offline.
        announcement: one sentence saying which backend was chosen and why.

    """

    def __init__(self, settings: Settings, store: Store, backend: Backend | None = None,
                 announcement: str | None = None) -> None:
        if backend is None:
            backend, announcement = build_backend(settings)
        self.settings = settings
        self.store = store
        self.backend: Backend = backend
        self.offline = _is_offline(backend)
        self.announcement = announcement or f"using the {backend.name} backend"

    def for_task(self, task_row: dict[str, Any], lease_token: uuid.UUID,
                 lease_lost: threading.Event) -> TaskLLM:
        """Return the model handle for one leased task (``ctx.llm``)."""
        return TaskLLM(self.settings, self.store, self.backend, task_row, lease_token,
                       lease_lost)

    def close(self) -> None:
        """Release the backend's connections."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


class TaskLLM:
    """Budget-aware model calls for one leased task; every call is recorded and charged."""

    def __init__(self, settings: Settings, store: Store, backend: Backend,
                 task_row: dict[str, Any], lease_token: uuid.UUID,
                 lease_lost: threading.Event) -> None:
        self._settings = settings
        self._store = store
        self._backend = backend
        self._lease_token = lease_token
        self._lease_lost = lease_lost
        self.task_id: uuid.UUID = task_row["id"]
        self._attempt = int(task_row.get("delivery_count") or 1)
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
        self.offline = _is_offline(backend)

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
        """Completion tokens this call may use; raises BudgetExceeded when too few remain."""
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
                 system: str | None = None, max_tokens: int | None = None) -> Completion:
        """Call the model for this task, within its budget, and charge the call.

        Args:
            prompt: the user prompt.
            schema: a pydantic model class or a JSON schema dict for structured output.
            system: an optional system prompt.
            max_tokens: completion tokens at most (default ``[ollama] num_predict``);
                shrunk to what the budget leaves.

        Raises:
            LeaseLost: the task was taken away (before the call, or found at charge time).
            UnknownPrice: the routed model has no price (a policy violation).
            BudgetExceeded: the call would overrun the budget; nothing was spent.
            TransientModelError: the model server is unreachable or timed out.
            ModelNotFound: the server lacks the routed model.
            BadModelReply: the reply does not fit the schema.
            ReplayMiss: replaying, and the request was never recorded.
            BadInput: the arguments themselves are wrong.

        """
        if self._lease_lost.is_set():
            raise LeaseLost(f"task {self.task_id}: lease lost; the model was not called")
        json_schema, model_cls = _schema_of(schema)
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadInput("complete() needs a non-empty prompt string")
        asked = self._settings.ollama.num_predict if max_tokens is None else int(max_tokens)
        if asked < 1:
            raise BadInput(f"max_tokens must be at least 1 (got {max_tokens})")
        route = decide_route(prompt, self._store.pending_depth(), self._settings)
        price = self._settings.cost.price_for(route.route, route.model)
        if price is None:
            raise UnknownPrice(
                f"model {route.model!r} (route {route.route}) has no price: set "
                f"cost.{route.route}_per_token, or a price for {route.model!r} in cost.prices, "
                "in orgchart.toml"
            )
        estimate = estimate_tokens(system) + estimate_tokens(prompt)
        with self._lock:
            allowed = self._allowed_completion(estimate, price, asked)
            reserved_tokens = estimate + allowed
            reserved_usd = reserved_tokens * price
            self._reserved_tokens += reserved_tokens
            self._reserved_usd += reserved_usd
            call_index = self._calls
            self._calls += 1
        stored_prompt = (request_text(prompt, system, json_schema) if self._settings.llm.record
                         else f"{NOT_RECORDED} request {request_key(prompt, system, json_schema)}")
        started = time.monotonic()
        charged_tokens = 0
        charged_usd = Decimal(0)
        try:
            try:
                reply = self._backend.chat(route.model, prompt, system, json_schema, allowed,
                                           route=route.route)
                data = _validated(reply, model_cls)
            except Exception as exc:
                spent = exc.reply if isinstance(exc, BadModelReply) else None
                charged_tokens, charged_usd = self._record_failure(
                    exc, spent, route, price, call_index, stored_prompt,
                    time.monotonic() - started)
                raise
            tokens = reply.prompt_tokens + reply.completion_tokens
            cost = (tokens * price).quantize(USD_QUANTUM)
            self._charge(ModelCharge(
                task_id=self.task_id, lease_token=self._lease_token, attempt=self._attempt,
                call_index=call_index, backend=reply.backend, route=route.route,
                route_reason=route.reason, model=route.model, prompt=stored_prompt,
                response=reply.text if self._settings.llm.record else None,
                prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens,
                duration_seconds=reply.duration_seconds, cost_usd=cost))
            charged_tokens, charged_usd = tokens, cost
        finally:
            with self._lock:
                self._reserved_tokens -= reserved_tokens
                self._reserved_usd -= reserved_usd
                self._spent_tokens += charged_tokens
                self._spent_usd += charged_usd
        return Completion(
            text=reply.text, data=data, prompt_tokens=reply.prompt_tokens,
            completion_tokens=reply.completion_tokens, cost_usd=cost, route=route.route,
            model=route.model, backend=reply.backend, offline=self.offline or reply.offline,
            route_reason=route.reason, duration_seconds=reply.duration_seconds,
            call_index=call_index)

    def _charge(self, charge: ModelCharge) -> None:
        if not self._store.charge(charge):
            raise LeaseLost(f"task {self.task_id}: lease lost; the model call was not charged "
                            "and its answer is dropped")

    def _record_failure(self, exc: Exception, reply: ModelReply | None, route: Route,
                        price: Decimal, call_index: int, stored_prompt: str,
                        duration: float) -> tuple[int, Decimal]:
        """Record a failed call (with the tokens it used, if any); return what was charged.

        A lost lease found here wins over the call's own error: the worker must drop the
        task rather than retry or fail it.
        """
        prompt_tokens = reply.prompt_tokens if reply else 0
        completion_tokens = reply.completion_tokens if reply else 0
        cost = ((prompt_tokens + completion_tokens) * price).quantize(USD_QUANTUM)
        charge = ModelCharge(
            task_id=self.task_id, lease_token=self._lease_token, attempt=self._attempt,
            call_index=call_index, backend=reply.backend if reply else self._backend.name,
            route=route.route, route_reason=route.reason, model=route.model,
            prompt=stored_prompt,
            response=reply.text if reply and self._settings.llm.record else None,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            duration_seconds=duration, cost_usd=cost,
            error=f"{type(exc).__name__}: {exc}")
        try:
            applied = self._store.charge(charge)
        except Exception:  # never hide the call's own error behind a recording error
            log.exception("could not record a failed model call",
                          extra={"task_id": str(self.task_id)})
            return 0, Decimal(0)
        if not applied:
            raise LeaseLost(f"task {self.task_id}: lease lost during a failed model call "
                            f"({exc})") from exc
        return prompt_tokens + completion_tokens, cost


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
