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
   is written (``[llm] durable``; with the task's outcome: ``calls.HeldReplays``);
3. routes the prompt (:func:`runtime.llm.routing.decide_route`) and prices the model
   (``[cost]``); no price -> :class:`~runtime.errors.UnknownPrice`;
4. reserves the request in the task's budget (:class:`runtime.budget.TaskBudget`: the
   estimated prompt tokens plus ``max_tokens``, shrunk to what is left, or
   :class:`~runtime.errors.BudgetExceeded`) and settles it with the server's counts after;
5. sends it once its tenant's token bucket has its tokens, at most ``[ollama]
   max_parallel`` at once per server, in fair order (:mod:`~runtime.llm.fair_slots`), once
   the start gate (:mod:`~runtime.llm.gate`) lets it; transient failures and bad
   structured replies are asked again;
6. records every attempt as a ``model_calls`` row (its error, its tokens, its kind:
   ``call``, ``retry`` or ``repair``) and charges it through the ledger
   (:class:`~runtime.llm.ledger.CallLedger`): the task's own spend and the row, nothing
   above it (spend rolls up to the parent when the task ends). Cost: ``(prompt +
   completion tokens) x the per-token price`` (:func:`runtime.budget.call_cost`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any, TypeVar

from pydantic import BaseModel

from agents.tasks import DEFAULT_BUDGET_TOKENS, DEFAULT_BUDGET_USD
from agents.tools import Tool
from runtime.budget import Reservation, TaskBudget, call_cost
from runtime.config import Settings
from runtime.errors import BadInput, BudgetExceeded, LeaseLost, TransientModelError
from runtime.llm.backends.choice import build_backend
from runtime.llm.calls import (
    Call,
    Completion,
    HeldReplays,
    Retries,
    Rows,
    answered,
    error_name,
    is_offline,
    price_of,
    replay_of,
    request_hash,
    request_hashes,
    schema_of,
    validated,
)
from runtime.llm.fair_slots import StopCheck, TaskStop, Ticket, TokenMeter
from runtime.llm.gate import CallGate
from runtime.llm.ledger import CallLedger, RecordedCall, RecordReader, step_ledger
from runtime.llm.loop import CallLoop, token_rates
from runtime.llm.reply import (
    NOT_RECORDED,
    Backend,
    BadModelReply,
    Message,
    ModelReply,
    first_messages,
    message_tokens,
    request_key,
    request_text,
)
from runtime.llm.routing import Route, decide_route
from runtime.llm.steps import TaskSteps
from runtime.llm.tool_loop import ToolRound, round_note, run_with_tools
from runtime.store.rows import ModelCharge

T = TypeVar("T")

log = logging.getLogger(__name__)

#: How much of a bad reply a repair sends back to the model.
MAX_REPAIR_ECHO_CHARS = 2000
#: Threads for the ledger's blocking reads (record look-ups, queue depth).
LEDGER_THREADS = 32
#: How long one read of the pending queue's depth serves routing decisions.
DEPTH_TTL_SECONDS = 0.5


class LLMFactory:
    """Builds the backend once and gives each leased task its :class:`TaskLLM`.

    Args:
        settings: the configuration.
        ledger: the database side (:class:`~runtime.llm.ledger.CallLedger`).
        backend / announcement: a backend to use instead of the one ``[llm] backend``
            names, and the sentence to announce with it.

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
        self.offline = is_offline(backend)
        self.announcement = announcement or f"using the {backend.name} backend"
        self.calls = CallLoop()
        self.calls.scheduler = settings.scheduler  # fair slots: max wait, anticipation
        self.calls.meter = TokenMeter(token_rates(settings),  # tokens_per_minute
                                      getattr(ledger, "take_tokens", None), self.in_ledger)
        #: The start gate of every request: cancelled tasks and paused trees (gate.py).
        self.gate = CallGate(getattr(ledger, "gate_calls", None), self.in_ledger)
        self.records = RecordReader(ledger, self.in_ledger)  # durable calls' look-ups
        # The ledger's blocking reads: a thousand calls in flight each look up a record.
        self._ledger_pool = ThreadPoolExecutor(max_workers=LEDGER_THREADS,
                                               thread_name_prefix="llm-ledger")
        self._depth: tuple[float, int] | None = None
        self._depth_reads: dict[asyncio.AbstractEventLoop, asyncio.Future[int]] = {}

    async def in_ledger(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one blocking ledger call off the loop, in the factory's ledger threads."""
        return await asyncio.get_running_loop().run_in_executor(self._ledger_pool, fn, *args)

    async def pending_depth(self) -> int:
        """The pending queue's depth for routing: one read per TTL and loop, shared."""
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

    def slot(self, route: Route, fair: tuple[str, Any, int], held: Reservation,
             stopped: StopCheck | None = None) -> Ticket:
        """A call's turn at its server's slots (``fair``: tenant, tree, priority; ``stopped``)."""
        host_for = getattr(self.backend, "host_for", None)
        host = host_for(route.route) if host_for is not None else self.backend.name
        o, (tenant, tree, priority) = self.settings.ollama, fair
        limit = o.cloud_max_parallel if route.route == "cloud" else o.max_parallel
        return self.calls.slot(host, route.model, limit).ticket(
            tenant, tree, priority, self.settings.tenant_weight(tenant),
            held.prompt_tokens + held.completion_tokens, stopped)

    async def aclose(self) -> None:
        """Release the backend's (and the ledger's) connections made on the running loop."""
        for owner in (self.backend, self.ledger):
            aclose = getattr(owner, "aclose", None)
            if aclose is not None:
                await aclose()

    def close(self) -> None:
        """Release the backend's connections, stop the factory's own loop (see detach)."""
        self.calls.close(self.aclose())
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()
        self._ledger_pool.shutdown(wait=False)


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
        self._stop = TaskStop(self.task_id, lease_lost, factory.gate.is_stopped)
        self._fair = (task_row.get("tenant") or "default", task_row.get("root_id"),
                      int(task_row.get("priority") or 5))
        self.phase = ("judge" if task_row.get("status") == "judging"
                      else str(task_row.get("phase") or "run"))
        self._attempt = int(task_row.get("delivery_count") or 1)
        # No reply of this phase on record (the claim says): no look-up until one is made.
        self._may_replay = bool(task_row.get("recorded_calls", True))
        # A fork's branch: its counterpart's record answers the calls it repeats; the fork
        # may have set its calls' model (docs/writing-agents.md).
        self._counterpart: uuid.UUID | None = task_row.get("forked_from")
        self._model_override: str | None = task_row.get("model_override")
        if self._counterpart is not None:
            self._may_replay = True
        budget_tokens = task_row.get("budget_tokens")
        budget_usd = task_row.get("budget_usd")
        #: The task's budget while it runs: reserve before each request, settle after.
        self.budget = TaskBudget(
            DEFAULT_BUDGET_TOKENS if budget_tokens is None else budget_tokens,
            Decimal(DEFAULT_BUDGET_USD if budget_usd is None else budget_usd),
            int(task_row.get("spent_tokens") or 0), Decimal(task_row.get("spent_usd") or 0),
            task=self.task_id)
        self._calls = 0
        self._lock = threading.Lock()
        self.offline = is_offline(self._backend)
        self.steps = TaskSteps(step_ledger(factory.ledger, self._counterpart), task_row,
                               lease_token, lease_lost,
                               in_ledger=factory.in_ledger, budget=self.budget)
        #: steps: ctx.step, tool calls; tool_check: allowed_tools' refusal (by the executor)
        self.tool_check: Callable[[str], str | None] | None = None
        self._rows = Rows(self.task_id, lease_token, self._attempt, self._backend.name,
                          self.phase, self._settings.llm.record)
        self.replays = HeldReplays(factory.ledger, lease_lost)  # for the outcome's write

    # ------------------------------------------------------------------ budget
    def remaining_tokens(self) -> int:
        """Tokens the task's subtree may still spend (requests in flight held back)."""
        return self.budget.remaining_tokens()

    def remaining_usd(self) -> Decimal:
        """USD the task's subtree may still spend (requests in flight held back)."""
        return self.budget.remaining_usd()

    # ------------------------------------------------------------------ the call
    def complete(self, prompt: str, *, schema: type[BaseModel] | dict[str, Any] | None = None,
                 system: str | None = None, max_tokens: int | None = None,
                 key: str | None = None, tools: Sequence[Tool] | None = None,
                 max_tool_rounds: int | None = None) -> Completion:
        """Call the model from synchronous code: :meth:`acomplete` run on the factory's loop.

        Takes the same arguments and raises the same errors as :meth:`acomplete`. Do not
        call it from a coroutine running on the factory's loop: await :meth:`acomplete`.
        """
        return self._factory.calls.run(self.acomplete(
            prompt, schema=schema, system=system, max_tokens=max_tokens, key=key, tools=tools,
            max_tool_rounds=max_tool_rounds))

    async def acomplete(self, prompt: str, *,
                        schema: type[BaseModel] | dict[str, Any] | None = None,
                        system: str | None = None, max_tokens: int | None = None,
                        key: str | None = None, tools: Sequence[Tool] | None = None,
                        max_tool_rounds: int | None = None) -> Completion:
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
            tools: tools the model may call (the loop of :mod:`runtime.llm.tool_loop`).
            max_tool_rounds: rounds of tool calls at most (default 8).

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
            ToolRoundLimit: the model still called tools after ``max_tool_rounds``.

        """
        if self._lease_lost.is_set():
            raise LeaseLost(f"task {self.task_id}: lease lost; the model was not called")
        json_schema, model_cls = schema_of(schema)
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
        if tools:  # every round is a call of its own, at position <position>#<round>
            return await run_with_tools(lambda at, rnd: self._call(
                prompt, system, json_schema, model_cls, asked, call_index, at, rnd),
                self.steps, tools, position, self.tool_check, first_messages(prompt, system),
                max_tool_rounds)
        return await self._call(
            prompt, system, json_schema, model_cls, asked, call_index, position)

    async def _call(self, prompt: str, system: str | None, json_schema: dict[str, Any] | None,
                    model_cls: type[BaseModel] | None, asked: int, call_index: int,
                    position: str, tools: ToolRound | None = None) -> Completion:
        settings = self._settings
        think = settings.ollama.think
        messages = tools.conversation if tools else first_messages(prompt, system)
        specs = tools.specs if tools else None
        hashes: dict[str, str] = {}
        if settings.llm.durable and settings.llm.record and self._may_replay:
            # Either route may have answered before: look for a reply to either model.
            models = ((self._model_override,) if self._model_override
                      else (settings.models.local, settings.models.cloud))
            hashes = request_hashes(models, messages, json_schema, asked, think, specs)
            recorded = await self._factory.records.read(  # batched with other calls' reads
                self.task_id, self.phase, position, sorted(set(hashes.values())),
                self._counterpart)
            if recorded is not None:
                replayed = await self._replayed(recorded, prompt, system, json_schema,
                                                model_cls, call_index, position, tools)
                if replayed is not None:
                    return replayed
        depth = await self._factory.pending_depth()
        route = decide_route(prompt, depth, settings)
        if self._model_override:
            route = Route(route.route, self._model_override,
                          f"{route.reason}; model {self._model_override} set by a fork")
        price = price_of(settings, route)
        digest = hashes.get(route.model) or request_hash(route.model, messages, json_schema,
                                                         asked, think, specs)
        stored_prompt = (request_text(prompt, system, json_schema) if settings.llm.record
                         else f"{NOT_RECORDED} request {request_key(prompt, system, json_schema)}")
        call = Call(position, call_index, digest, stored_prompt + round_note(tools), route,
                    price, tools=specs or [],
                    first_kind="repair" if tools and tools.repair else "call")
        reply, data = await self._with_repairs(call, messages, json_schema, model_cls, asked,
                                               think)
        self._may_replay = True  # this reply is on record now (a repeated key replays it)
        return answered(call, reply, data, self.offline)

    async def _with_repairs(self, call: Call, messages: list[Message],
                            json_schema: dict[str, Any] | None,
                            model_cls: type[BaseModel] | None, asked: int,
                            think: bool) -> tuple[ModelReply, Any]:
        """Ask, and ask again with the error while a structured reply is bad."""
        conversation = list(messages)
        rounds = 1 + (self._settings.llm.output_retries if json_schema else 0)
        errors: list[str] = []
        for number in range(rounds):
            kind = call.first_kind if number == 0 else "repair"
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

    async def _with_retries(self, call: Call, conversation: list[Message],
                            json_schema: dict[str, Any] | None,
                            model_cls: type[BaseModel] | None, asked: int, think: bool,
                            kind: str) -> tuple[ModelReply, Any]:
        """Send, retrying transient failures with backoff; ``Retry-After`` and 503 waits."""
        retries = Retries(self._settings.llm)
        while True:
            try:
                return await self._request(call, conversation, json_schema, model_cls, asked,
                                           think, kind)
            except TransientModelError as exc:
                delay = retries.delay(exc, call.rows)  # raises when out of retries
                kind = "retry"
                await asyncio.sleep(delay)
                if self._lease_lost.is_set():
                    raise LeaseLost(f"task {self.task_id}: lease lost while the model call "
                                    "waited to retry") from exc

    async def _request(self, call: Call, conversation: list[Message],
                       json_schema: dict[str, Any] | None, model_cls: type[BaseModel] | None,
                       asked: int, think: bool, kind: str) -> tuple[ModelReply, Any]:
        """One request: budget check, send, check the reply, record and charge it."""
        if self._lease_lost.is_set():
            raise LeaseLost(f"task {self.task_id}: lease lost; the model was not called")
        route, price = call.route, call.price
        # Reserve (budget rule 3); the finally below settles with what was charged (rule 4).
        held = self.budget.reserve(message_tokens(conversation), asked, price)
        call.rows += 1
        started = time.monotonic()
        charged_tokens, charged_usd = 0, Decimal(0)
        try:
            try:
                ticket = self._factory.slot(route, self._fair, held, self._stop)
                reply = await self._factory.gate.send(  # cancelled? paused? (gate.py)
                    self.task_id, ticket,
                    lambda: ticket.answer(self._backend.achat(
                        route.model, conversation, json_schema, held.completion_tokens,
                        route=route.route, think=think,
                        **({"tools": call.tools} if call.tools else {}))),
                    lease_token=self._lease_token)
                ticket.settle(reply.prompt_tokens + reply.completion_tokens)  # its spend
                data = validated(reply, model_cls)
            except Exception as exc:
                spent = exc.reply if isinstance(exc, BadModelReply) else None
                charged_tokens, charged_usd = await self._record_failure(
                    exc, spent, call, kind, time.monotonic() - started)
                raise
            tokens = reply.prompt_tokens + reply.completion_tokens
            cost = call_cost(tokens, price)
            await self._charge(self._rows.row(call, kind, reply, reply.prompt_tokens,
                                         reply.completion_tokens, reply.duration_seconds,
                                         cost, None))
            charged_tokens, charged_usd = tokens, cost
            call.cost += cost
            return reply, data
        finally:
            settled = self.budget.settle(held, charged_tokens, charged_usd)
            if settled.over_tokens > 0:
                log.info("a request spent more than it reserved (the server counted more "
                         "prompt tokens than estimated)",
                         extra={"task_id": str(self.task_id), "over": settled.over_tokens})

    async def _charge(self, charge: ModelCharge) -> None:
        if not await self._factory.charge(charge):
            raise LeaseLost(f"task {self.task_id}: lease lost; the model call was not charged "
                            "and its answer is dropped")

    async def _record_failure(self, exc: Exception, reply: ModelReply | None, call: Call,
                              kind: str, duration: float) -> tuple[int, Decimal]:
        """Record a failed request (with the tokens it used, if any); return what was charged.

        A lost lease found here wins over the call's own error: the worker must drop the
        task rather than retry or fail it.
        """
        if isinstance(exc, (LeaseLost, BudgetExceeded, asyncio.CancelledError)):
            return 0, Decimal(0)
        prompt_tokens = reply.prompt_tokens if reply else 0
        completion_tokens = reply.completion_tokens if reply else 0
        cost = call_cost(prompt_tokens + completion_tokens, call.price)
        charge = self._rows.row(call, kind, reply, prompt_tokens, completion_tokens, duration,
                           cost, f"{error_name(exc)}: {exc}")
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
                        call_index: int, position: str,
                        tools: ToolRound | None = None) -> Completion | None:
        """Serve a recorded reply (charged zero, a ``replayed`` row); None if it is unusable."""
        replay = replay_of(recorded, prompt, system, json_schema, model_cls, call_index,
                           position, tools)
        if replay is None:
            return None
        call, reply = replay
        if not self.replays.hold(self._rows, call, reply):  # not held: written now
            await self._charge(self._rows.replayed(call, reply))
        return answered(call, reply, reply.data, self.offline, replayed=True)
