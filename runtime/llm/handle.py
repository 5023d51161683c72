"""The model layer agents use: ``ctx.llm.acomplete(...)`` / ``complete(...)``, per task.

:class:`LLMFactory` builds the backend once per process (``[llm] backend``; ``auto`` says
which it chose in :attr:`LLMFactory.announcement`), and hands each leased task a
:class:`TaskLLM`. One call (:meth:`TaskLLM.acomplete`, on the caller's loop;
:meth:`TaskLLM.complete` submits it to the worker's loop, or the model layer's own, and
waits) refuses when the task's lease is lost, checks its arguments and builds one
:class:`~runtime.llm.request.Request` (frozen). :meth:`TaskLLM._call` runs its stages in
order, top to bottom (docs/architecture.md, "One model call, stage by stage", lists its
hops):

1. the record look-up (:class:`~runtime.llm.recorded.RecordedReplies`): a reply on
   record for the same identity is served at once, charged zero;
2. the route (:class:`~runtime.llm.routing.Router`): local or cloud, its price, the
   record key, the stored prompt, as one frozen :class:`~runtime.llm.routing.Routed`;
   the requests' own state is the call's :class:`~runtime.llm.request.CallProgress`;
3. requests until one is answered (:meth:`~runtime.llm.sending.Sender.attempt`: reserve
   in the task's budget, take a slot at its server
   (:class:`~runtime.llm.server_slots.ServerSlots`), pass the start gate
   (:mod:`~runtime.llm.gate`), send, record on arrival, validate, and charge its row
   (:class:`~runtime.llm.charging.Charger`): the task's own spend, nothing above it;
   spend rolls up to the parent when the task ends);
4. a transient failure is sent again after its backoff
   (:class:`~runtime.llm.retries.Retries`), a bad structured reply is asked again with
   its error (:class:`~runtime.llm.repair.Repairs`).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any, TypeVar, overload

from pydantic import BaseModel

from agents.replies import Completion
from agents.tasks import DEFAULT_BUDGET_TOKENS, DEFAULT_BUDGET_USD
from agents.tools import Tool
from runtime.budget import TaskBudget
from runtime.config import Settings
from runtime.errors import BadInput, LeaseLost, TransientModelError
from runtime.llm.backends.choice import build_backend
from runtime.llm.call_records import HeldReplays, Rows
from runtime.llm.charging import Charger
from runtime.llm.completion import answered, is_offline
from runtime.llm.durable_steps import TaskSteps
from runtime.llm.gate import CallGate, TaskStop
from runtime.llm.ledger import CallLedger, RecordReader, step_ledger
from runtime.llm.loop import CallLoop, token_rates
from runtime.llm.recorded import RecordedReplies
from runtime.llm.recorder import RECORDERS, Hello, Recorder
from runtime.llm.repair import Repairs
from runtime.llm.reply import Backend, BadModelReply, first_messages
from runtime.llm.reply_loop import REPLY_LOOP
from runtime.llm.request import CallProgress, Request, schema_of
from runtime.llm.retries import Retries
from runtime.llm.routing import Router
from runtime.llm.sending import Sender
from runtime.llm.server_slots import Fair, ServerSlots
from runtime.llm.text_stream import TextSink
from runtime.llm.token_meter import TokenMeter
from runtime.llm.tool_loop import ToolRound, run_with_tools

T = TypeVar("T")
#: The pydantic class a structured call's output is an instance of.
M = TypeVar("M", bound=BaseModel)

#: Threads for the ledger's blocking reads (record look-ups, queue depth).
LEDGER_THREADS = 32


class LLMFactory:
    """Builds the backend once and gives each leased task its :class:`TaskLLM`.

    Args:
        settings: the configuration.
        ledger: the database side (:class:`~runtime.llm.ledger.CallLedger`).
        text: where streamed text is written (:class:`~runtime.llm.text_stream.TextSink`;
            ``[streaming] enabled``), else None: nothing is recorded as it streams.
        backend / announcement: a backend to use instead of the one ``[llm] backend``
            names, and the sentence to announce with it.

    Attributes:
        backend: the backend every task shares.
        offline: True for the offline backend, and for a replay of a run recorded offline.
        announcement: one sentence saying which backend was chosen and why.
        calls / gate / records / router / slots: the stages every task's calls share.

    """

    def __init__(self, settings: Settings, ledger: CallLedger, backend: Backend | None = None,
                 announcement: str | None = None, text: TextSink | None = None) -> None:
        if backend is None:
            backend, announcement = build_backend(settings)
        self.settings = settings
        self.ledger = ledger
        #: Where requests' streamed text is written (``[streaming]`` on), else None.
        self.text = text
        self.backend: Backend = backend
        self.offline = is_offline(backend)
        self.announcement = announcement or f"using the {backend.name} backend"
        # The ledger's blocking reads: a thousand calls in flight each look up a record.
        self._ledger_pool = ThreadPoolExecutor(max_workers=LEDGER_THREADS,
                                               thread_name_prefix="llm-ledger")
        self.calls = CallLoop()
        self.calls.scheduler = settings.scheduler  # fair slots: max wait, anticipation
        self.calls.meter = TokenMeter(token_rates(settings),  # tokens_per_minute
                                      ledger.take_tokens, self.in_ledger)
        #: The start gate of every request: cancelled tasks and paused trees (gate.py).
        self.gate = CallGate(ledger.gate_calls, self.in_ledger)
        self.records = RecordReader(ledger)  # durable calls' look-ups, batched
        self.router = Router(settings, lambda: self.in_ledger(ledger.pending_depth), backend)
        self.slots = ServerSlots(self.calls, backend, settings)
        #: A remote backend's requests go through the recorder process (``[ollama]
        #: recorder``; :mod:`runtime.llm.recorder`) while a worker is attached.
        url = (ledger.charges_url() if settings.ollama.recorder
               and backend.recorder_spec() is not None else None)
        self._recorder_hello = (None if url is None else
                                Hello(url, settings.database.statement_timeout_ms))
        self._recorder: Recorder | None = None
        self._recorder_lock = threading.Lock()

    async def in_ledger(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one blocking ledger call off the loop, in the factory's ledger threads."""
        return await asyncio.get_running_loop().run_in_executor(self._ledger_pool, fn, *args)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make sync callers' calls on ``loop`` (a worker's, while it runs).

        A worker's recorder process is started now (:meth:`recorder`), not by its
        first call.
        """
        self.calls.attach(loop)
        with self._recorder_lock:
            if self._recorder_hello is not None and self._recorder is None:
                self._recorder = RECORDERS.acquire(self._recorder_hello)
                self._recorder.prestart()

    async def detach(self) -> None:
        """From a coroutine on an attached loop about to close: close its connections."""
        await self.aclose()
        self.calls.detach(asyncio.get_running_loop())

    def recorder(self) -> Recorder | None:
        """The recorder process of a running worker's remote requests (None: read here).

        Taken when a worker attaches its loop, given back when it detaches: calls made
        outside a worker (a script, a test's handle) read their replies in this process.
        """
        return self._recorder

    def for_task(self, task_row: dict[str, Any], lease_token: uuid.UUID,
                 lease_lost: threading.Event) -> TaskLLM:
        """Return the model handle for one leased task (``ctx.llm``)."""
        return TaskLLM(self, task_row, lease_token, lease_lost)

    async def aclose(self) -> None:
        """Release the backend's (and the ledger's) connections made on the running loop.

        A remote backend's connections on the reply loop are closed too.
        """
        await self.backend.aclose()
        if self.backend.remote:  # its connections on the reply loop too
            await REPLY_LOOP.call(self.backend.aclose)
        with self._recorder_lock:
            recorder, self._recorder = self._recorder, None
        if recorder is not None:  # the recorder process ends with its last user
            await REPLY_LOOP.call(functools.partial(RECORDERS.release, recorder))
        await self.ledger.aclose()

    def close(self) -> None:
        """Release the backend's connections, stop the factory's own loop (see detach)."""
        self.calls.close(self.aclose())
        self.backend.close()
        self._ledger_pool.shutdown(wait=False)


def task_budget(task_row: dict[str, Any]) -> TaskBudget:
    """The budget of a task while it runs, from its row (the defaults when unset)."""
    budget_tokens = task_row.get("budget_tokens")
    budget_usd = task_row.get("budget_usd")
    return TaskBudget(
        DEFAULT_BUDGET_TOKENS if budget_tokens is None else budget_tokens,
        Decimal(DEFAULT_BUDGET_USD if budget_usd is None else budget_usd),
        int(task_row.get("spent_tokens") or 0), Decimal(task_row.get("spent_usd") or 0),
        task=task_row["id"])


class TaskLLM:
    """Budget-aware model calls for one leased task; every attempt is recorded and charged."""

    def __init__(self, factory: LLMFactory, task_row: dict[str, Any], lease_token: uuid.UUID,
                 lease_lost: threading.Event) -> None:
        self._factory = factory
        self._settings = factory.settings
        self._lease_lost = lease_lost
        self.task_id: uuid.UUID = task_row["id"]
        self.phase = ("judge" if task_row.get("status") == "judging"
                      else str(task_row.get("phase") or "run"))
        #: The task's budget while it runs: reserve before each request, settle after.
        self.budget = task_budget(task_row)
        self._calls = 0
        self._lock = threading.Lock()
        self.offline = is_offline(factory.backend)
        rows = Rows(self.task_id, lease_token, int(task_row.get("delivery_count") or 1),
                    factory.backend.name, self.phase, self._settings.llm.record)
        charger = Charger(factory.ledger, rows)
        self.replays = HeldReplays(factory.ledger, lease_lost)  # for the outcome's write
        self._recorded = RecordedReplies(self._settings, factory.records, task_row,
                                         self.phase, charger, self.replays, self.offline,
                                         served=factory.router.served_model)
        fair = Fair(task_row.get("tenant") or "default", task_row.get("root_id"),
                    int(task_row.get("priority") or 5))
        stop = TaskStop(self.task_id, lease_lost, factory.gate.is_stopped)
        self._sender = Sender(factory.backend, factory.slots, factory.gate, self.budget,
                              charger, fair, stop, lease_token, lease_lost,
                              text=factory.text,
                              continue_cut_off=self._settings.streaming.continue_cut_off,
                              recorder=factory.recorder)
        self.steps = TaskSteps(step_ledger(factory.ledger, self._recorded.counterpart),
                               task_row, lease_token, lease_lost,
                               in_ledger=factory.in_ledger, budget=self.budget)
        #: steps: ctx.step, tool calls; tool_check: allowed_tools' refusal (by the executor)
        self.tool_check: Callable[[str], str | None] | None = None

    # ------------------------------------------------------------------ budget
    def remaining_tokens(self) -> int:
        """Tokens the task's subtree may still spend (requests in flight held back)."""
        return self.budget.remaining_tokens()

    def remaining_usd(self) -> Decimal:
        """USD the task's subtree may still spend (requests in flight held back)."""
        return self.budget.remaining_usd()

    # ------------------------------------------------------------------ the call
    @overload
    def complete(self, prompt: str, *, schema: type[M], system: str | None = None,
                 max_tokens: int | None = None, key: str | None = None,
                 tools: Sequence[Tool] | None = None,
                 max_tool_rounds: int | None = None) -> Completion[M]: ...

    @overload
    def complete(self, prompt: str, *, schema: dict[str, Any], system: str | None = None,
                 max_tokens: int | None = None, key: str | None = None,
                 tools: Sequence[Tool] | None = None,
                 max_tool_rounds: int | None = None) -> Completion[Any]: ...

    @overload
    def complete(self, prompt: str, *, schema: None = None, system: str | None = None,
                 max_tokens: int | None = None, key: str | None = None,
                 tools: Sequence[Tool] | None = None,
                 max_tool_rounds: int | None = None) -> Completion[str]: ...

    def complete(self, prompt: str, *, schema: type[BaseModel] | dict[str, Any] | None = None,
                 system: str | None = None, max_tokens: int | None = None,
                 key: str | None = None, tools: Sequence[Tool] | None = None,
                 max_tool_rounds: int | None = None) -> Completion[Any]:
        """Call the model from synchronous code: :meth:`acomplete` run on the factory's loop.

        Takes the same arguments and raises the same errors as :meth:`acomplete`. Do not
        call it from a coroutine running on the factory's loop: await :meth:`acomplete`.
        """
        return self._factory.calls.run(self.acomplete(
            prompt, schema=schema, system=system, max_tokens=max_tokens,
            key=key, tools=tools, max_tool_rounds=max_tool_rounds))

    @overload
    async def acomplete(self, prompt: str, *, schema: type[M], system: str | None = None,
                        max_tokens: int | None = None, key: str | None = None,
                        tools: Sequence[Tool] | None = None,
                        max_tool_rounds: int | None = None) -> Completion[M]: ...

    @overload
    async def acomplete(self, prompt: str, *, schema: dict[str, Any],
                        system: str | None = None, max_tokens: int | None = None,
                        key: str | None = None, tools: Sequence[Tool] | None = None,
                        max_tool_rounds: int | None = None) -> Completion[Any]: ...

    @overload
    async def acomplete(self, prompt: str, *, schema: None = None, system: str | None = None,
                        max_tokens: int | None = None, key: str | None = None,
                        tools: Sequence[Tool] | None = None,
                        max_tool_rounds: int | None = None) -> Completion[str]: ...

    async def acomplete(self, prompt: str, *,
                        schema: type[BaseModel] | dict[str, Any] | None = None,
                        system: str | None = None, max_tokens: int | None = None,
                        key: str | None = None, tools: Sequence[Tool] | None = None,
                        max_tool_rounds: int | None = None) -> Completion[Any]:
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

        call = Request(prompt, system, json_schema, model_cls, asked,
                       self._settings.ollama.think, call_index, position)
        if tools:  # every round is a call of its own, at position <position>#<round>
            completion: Completion[Any] = await run_with_tools(
                functools.partial(self._call, call), self.steps, tools, position,
                self.tool_check, first_messages(prompt, system), max_tool_rounds)
            return completion
        return await self._call(call, position)

    async def _call(self, asked: Request, at: str,
                    round_: ToolRound | None = None) -> Completion[Any]:
        """One logical call at position ``at`` (a tool loop's ``round_``): its stages in order.

        The record look-up, the route, then requests (:meth:`Sender.attempt`: reserve,
        slot, gate, send, record on arrival, validate, charge) until one is answered: a
        transient failure is retried (:class:`Retries`), a bad structured reply repaired
        (:class:`Repairs`). docs/architecture.md, "One model call", lists the hops.
        """
        request = asked.at(at, round_)
        # 1. The record: a reply on record for this identity is served, charged zero.
        replayed = await self._recorded.answer(request)
        if replayed is not None:
            return replayed
        # 2. The route: local or cloud, its price, its record key, its stored prompt.
        routed = await self._factory.router.route(request, self._recorded.model_override)
        # 3. Requests until one is answered; each one's own stages are Sender.attempt's.
        call = CallProgress.start(request, routed)
        llm = self._settings.llm
        repairs, retries = Repairs(request, llm.output_retries), Retries(llm)
        while True:
            try:
                reply, output = await self._sender.attempt(call)
                break
            except TransientModelError as exc:  # 4. retry, after its backoff
                await retries.wait(exc, call, self._lease_lost, self.task_id)
            except BadModelReply as exc:  # 5. repair: asked again with the error
                repairs.again(exc, call)
                retries = Retries(llm)  # each repair has retries of its own
        self._recorded.recorded()  # this reply is on record now (a repeated key replays it)
        return answered(call, reply, output, self.offline)
