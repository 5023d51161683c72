"""Turns one claimed task into one action: what the agent (or the judge) decided.

The executor runs in a worker thread and never writes task state itself: it returns an
action that the worker applies with one guarded statement (batched where it can). Order
for a run: input schema -> ``validate_input`` policies -> ``agent.run`` or
``agent.aggregate`` -> output policies -> ``judging``. A delegation is checked by the
delegation policies, its children's payloads against their agents' schemas, and its
budgets are carved from what the parent has left.

Errors decide the outcome: a transient model error goes back to ``pending`` with backoff
``2 ** retry_count`` seconds up to ``retry.max_retry``; ``ModelNotFound`` and agent
exceptions end ``failed``; ``BudgetExceeded`` ends ``failed`` with ``budget: ...``;
``UnknownPrice`` and policy violations end ``escalated`` naming the rule.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from decimal import Decimal
from typing import Any, Protocol

import psycopg
import sqlalchemy as sa
from pydantic import BaseModel

from agents.base import (
    ChildSpec,
    Delegate,
    Escalate,
    Fail,
    Result,
    RetryChildren,
    agent_logger,
)
from agents.context import PROMPTS_DIR, AgentContext
from agents.registry import InvalidInput, Registry, UnknownAgent
from agents.tasks import ChildView, TaskView
from policies.criteria import validate_criteria
from runtime.budget import Ask, BudgetRefused, ChildSpend, TaskBudget, carve, check_retry
from runtime.config import Settings
from runtime.core import backoff
from runtime.engine.actions import Action, DelegateAction, Dropped, RetryAction
from runtime.engine.judge_stage import accepted, judge_task, undecided
from runtime.engine.started import (
    RACED,
    LazyLLM,
    Started,
    built_llm,
    check_tools_with,
    raced,
    reads_children,
    stamped,
)
from runtime.errors import (
    BadInput,
    BudgetExceeded,
    LeaseLost,
    ModelNotFound,
    TransientModelError,
    UnknownPrice,
)
from runtime.llm.call_records import defer_replays
from runtime.llm.gate import CallGate
from runtime.llm.loop import CallLoop
from runtime.llm.tool_loop import ToolApprovalNeeded
from runtime.store.rows import ChildRow, JudgeOutcome, RunOutcome, TaskRow
from runtime.store.store import Store

log = logging.getLogger(__name__)


class PolicyChecks(Protocol):
    """What the executor needs from ``policies.loader.PolicySet``."""

    def validate_input(self, task: TaskView) -> Any:
        """First input violation, or None."""

    def validate_output(self, task: TaskView, result: Any) -> Any:
        """First output violation, or None."""

    def validate_delegation(self, parent: TaskView, children: list[ChildSpec]) -> Any:
        """First delegation violation, or None."""


class LLMFactoryLike(Protocol):
    """What the worker needs from ``runtime.llm.handle.LLMFactory`` (nothing probed)."""

    offline: bool
    #: The model calls' slots and token meter (how many are running, waiting, metered).
    calls: CallLoop
    #: The start gate of every request (cancelled tasks, paused trees).
    gate: CallGate

    def for_task(self, task_row: Any, lease_token: uuid.UUID,
                 lease_lost: threading.Event) -> Any:
        """A ``ctx.llm`` bound to one leased task."""

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make sync callers' calls on ``loop`` (the worker's, while it runs)."""

    async def detach(self) -> None:
        """From a coroutine on the attached loop about to close: close its connections."""


class JudgeFn(Protocol):
    """``runtime.engine.judge_stage.judge_task``."""

    def __call__(self, task: Any, children: list[Any], llm: Any,
                 settings: Settings) -> Any:
        """Judge one task; returns a ``Judgement``."""


#: Errors that mean the database connection went away (restart, terminated backend):
#: SQLAlchemy's, and psycopg's own from the async step writer and record look-ups.
DATABASE_GONE: tuple[type[Exception], ...] = (sa.exc.OperationalError, sa.exc.InterfaceError,
                                              psycopg.OperationalError, psycopg.InterfaceError)
#: Infrastructure errors a task is retried for with backoff (seed 001).
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (TransientModelError, *DATABASE_GONE)
#: Errors that leave a judging task to the reaper (it goes back to the judge stage).
JUDGE_INTERRUPTED: tuple[type[Exception], ...] = (LeaseLost, *DATABASE_GONE)


class DelegationRefused(Exception):
    """A delegation the runtime will not write (bad child, budget, unknown agent)."""


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _run_to_end(work: Coroutine[Any, Any, Action]) -> Action:
    """Run in this thread a coroutine whose steps block instead of suspending.

    :meth:`Executor.execute`'s steps never give the loop a turn (there is none: a worker
    thread), so one ``send`` runs the coroutine to its end.
    """
    try:
        work.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    work.close()
    raise RuntimeError("a blocking step of a task suspended without an event loop")


def _typed(row: TaskRow | dict[str, Any]) -> TaskRow:
    """The engine works on typed rows; a mapping (a test, a caller by hand) is typed here."""
    return row if isinstance(row, TaskRow) else TaskRow.from_mapping(row)


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


def _left(parent: TaskView, llm: Any) -> tuple[int, Decimal]:
    """What a parent has left to carve: its llm knows this run's spend and calls in flight."""
    if hasattr(llm, "remaining_tokens"):
        return int(llm.remaining_tokens()), Decimal(llm.remaining_usd())
    return (parent.budget_tokens - parent.spent_tokens,
            Decimal(parent.budget_usd) - Decimal(parent.spent_usd))


def _check_retry_budget(parent: TaskView, llm: Any, child_ids: list[uuid.UUID],
                        children: list[TaskRow]) -> None:
    """Budget rule 2 (:func:`runtime.budget.check_retry`): retried children must fit."""
    wanted = set(child_ids)
    retried = [c for c in children if c.id in wanted]
    try:
        check_retry(*_left(parent, llm), [
            ChildSpend(int(c.budget_tokens or 0), Decimal(c.budget_usd or 0),
                       int(c.spent_tokens or 0), Decimal(c.spent_usd or 0)) for c in retried])
    except BudgetRefused as exc:
        raise DelegationRefused(str(exc)) from None


class Executor:
    """Runs agents and the judge for claimed tasks and says what should happen next."""

    def __init__(self, *, store: Store, registry: Registry, settings: Settings,
                 policies: PolicyChecks, llm_factory: LLMFactoryLike, judge: JudgeFn,
                 tools_for: Callable[[str], tuple[Any, ...]] | None = None) -> None:
        self.store = store
        #: The MCP tools configured for an agent (``[mcp.servers.*] agents``), by name.
        self.tools_for = tools_for
        self.registry = registry
        self.settings = settings
        self.policies = policies
        self.llm_factory = llm_factory
        self.judge = judge
        #: Set by a worker that also runs the judge stage: results whose criteria need no
        #: model are judged right away and written with the run's outcome.
        self.inline_judge = False
        self._loggers: dict[str, logging.Logger] = {}
        self._async: dict[tuple[type, bool], bool] = {}

    # ------------------------------------------------------------------ run stage
    def is_async(self, row: TaskRow) -> bool:
        """Whether the agent method this task needs (``run`` or ``aggregate``) is ``async``.

        Asked twice a task: the answer is kept per agent class and phase.
        """
        try:
            cls = self.registry.get(row.to_agent)
        except UnknownAgent:
            return False
        key = (cls, row.phase == "aggregate")
        found = self._async.get(key)
        if found is None:
            method = cls.aggregate if key[1] else cls.run
            found = self._async[key] = inspect.iscoroutinefunction(method)
        return found

    def execute(self, row: TaskRow | dict[str, Any], lease_lost: threading.Event) -> Action:
        """Run (or aggregate) one claimed ``running`` task and return its action.

        Blocking: meant for a worker thread. The children are read here; an ``async def``
        agent method is run to the end on a private event loop (the worker awaits those
        with :meth:`aexecute`). The same body as :meth:`aexecute` (:meth:`_work`).
        """
        async def read_children(task_id: uuid.UUID) -> list[TaskRow]:
            return self.store.claims.child_rows(task_id)  # blocks: this is a worker thread

        async def on_private_loop(decision: Awaitable[Any]) -> Any:
            return asyncio.run(_awaited(decision))

        return _run_to_end(self._work(_typed(row), lease_lost, read_children, on_private_loop))

    async def aexecute(self, row: TaskRow, lease_lost: threading.Event,
                       blocking: Callable[..., Awaitable[Any]]) -> Action:
        """Like :meth:`execute`, for an ``async def`` agent, awaited on the worker's loop.

        ``blocking(fn, *args)`` runs a blocking call (the children's read) off the loop and
        returns its result. The decision's checks (the policies, the inline judge) run on
        the loop, as the input's do: they read nothing from the database.
        """
        async def read_children(task_id: uuid.UUID) -> list[TaskRow]:
            return await blocking(self.store.claims.child_rows, task_id)

        return await self._work(_typed(row), lease_lost, read_children, _awaited)

    async def _work(self, row: TaskRow, lease_lost: threading.Event,
                    read_children: Callable[[uuid.UUID], Awaitable[list[TaskRow]]],
                    resolve: Callable[[Awaitable[Any]], Awaitable[Any]]) -> Action:
        """The one body of :meth:`execute` and :meth:`aexecute`: start, call, decide.

        They differ in how the children are read (``read_children``) and how an async
        agent's decision is waited for (``resolve``); every error the agent's work raises
        becomes the task's action here.
        """
        started = self._start(row, lease_lost)
        if not isinstance(started, Started):
            return started
        try:
            children: list[TaskRow] = []
            if reads_children(started):
                children = await read_children(started.row.id)
                if started.view.phase == "aggregate" and raced(children):
                    return started.outcome("waiting", detail=RACED)
            decision = self._call(started, children)
            if inspect.isawaitable(decision):
                decision = await resolve(decision)
            return stamped(started, self._decide(started, decision, children))
        except Exception as exc:
            return stamped(started, self._failed(started, exc))

    def _start(self, row: TaskRow, lease_lost: threading.Event) -> Started | RunOutcome:
        """Resolve the agent, check the input, build the context (no database, no model)."""
        token: uuid.UUID = row.lease
        task_id: uuid.UUID = row.id

        def outcome(to_status: str, result: Any = None, error: str | None = None,
                    delay: float = 0.0, detail: str | None = None) -> RunOutcome:
            return RunOutcome(task_id, token, to_status, result=result, error=error,
                              delay_seconds=delay, detail=detail or error)

        try:
            cls = self.registry.get(row.to_agent)
        except UnknownAgent as exc:
            return outcome("failed", error=str(exc))
        try:
            input_value = self.registry.validate_input(row.to_agent, row.payload)
        except InvalidInput as exc:
            return outcome("escalated", error=f"policy input_schema: {exc}")
        view = TaskView.from_row(row, input_value)
        violation = self.policies.validate_input(view)
        if violation is not None:
            return outcome("escalated", error=str(violation))
        llm = LazyLLM(lambda: self._llm_for(row, token, lease_lost, view))
        tools = tuple(cls.tools) + (self.tools_for(cls.name) if self.tools_for else ())
        ctx = AgentContext(llm=llm, task=view, log=self._logger(cls.name), lease_lost=lease_lost,
                           offline=self.llm_factory.offline,
                           prompts_dir=cls.prompts_dir or PROMPTS_DIR, tools=tools)
        return Started(row, cls, cls(), view, ctx, llm, outcome)

    def _llm_for(self, row: TaskRow, token: uuid.UUID, lease_lost: threading.Event,
                 view: TaskView) -> Any:
        """The model handle of one leased task, its tool calls checked by the policies."""
        llm = defer_replays(self.llm_factory.for_task(row, token, lease_lost))
        check_tools_with(llm, self.policies, view)
        return llm

    def _logger(self, agent: str) -> logging.Logger:
        """``agent_logger(agent)``, looked up once per agent."""
        logger = self._loggers.get(agent)
        if logger is None:
            logger = self._loggers[agent] = agent_logger(agent)
        return logger

    @staticmethod
    def _call(started: Started, children: list[TaskRow]) -> Any:
        """Call ``run`` or ``aggregate``: a decision, or a coroutine that returns one."""
        if started.view.phase == "aggregate":
            return started.agent.aggregate(started.ctx, started.view,
                                           [ChildView.from_row(c) for c in children])
        return started.agent.run(started.ctx, started.view)

    def _failed(self, started: Started, exc: Exception) -> Action:
        """Turn an error raised while the agent worked into the task's action."""
        outcome, row = started.outcome, started.row
        if isinstance(exc, LeaseLost):
            return Dropped(row.id, "lease lost while the agent worked")
        if isinstance(exc, concurrent.futures.CancelledError) and started.ctx.lease_lost.is_set():
            # A stopping worker let the task go while a sync agent's call waited on its loop.
            return Dropped(row.id, "let go while its model call waited")
        if isinstance(exc, ToolApprovalNeeded):  # held until a person approves the call
            return outcome("awaiting_approval", error=exc.detail, detail=exc.detail)
        if isinstance(exc, TRANSIENT_ERRORS):
            # The model server or the database went away mid-task: infrastructure, retried.
            retries = int(row.retry_count or 0)
            if retries < self.settings.retry.max_retry:
                delay = backoff.delay(retries, 1.0)  # seed 001: 2 ** retry_count s
                return outcome("pending", delay=delay,
                               error=f"transient: {exc}",
                               detail=f"transient error, retry {retries + 1} in {delay:g}s: {exc}")
            return outcome("failed", error=f"transient error persisted after {retries} retries: "
                           f"{exc}")
        if isinstance(exc, ModelNotFound | BudgetExceeded):
            return outcome("failed", error=str(exc))
        if isinstance(exc, UnknownPrice):
            return outcome("escalated", error=f"policy {UnknownPrice.rule}: {exc}")
        if isinstance(exc, DelegationRefused):
            return outcome("failed", error=f"delegation refused: {exc}")
        log.warning("agent raised", extra={
            "task_id": str(row.id), "agent": started.cls.name,
            "trace": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))})
        return outcome("failed", error=f"agent error: {type(exc).__name__}: {exc}")

    def _decide(self, started: Started, decision: Any, children: list[TaskRow]) -> Action:
        """Turn the agent's decision into an action: checks only, no database.

        ``children`` are the rows read before the agent ran (:func:`_reads_children`; an
        aggregate's are all finished): the inline judge counts their failures and a
        reassignment checks them, so the decision is judged on what the agent saw.
        """
        cls, view, row, llm, outcome = (started.cls, started.view, started.row, started.llm,
                                        started.outcome)
        if isinstance(decision, Result):
            result = _jsonable(decision.output)
            violation = self.policies.validate_output(view, result)
            if violation is not None:
                return outcome("escalated", result=result, error=str(violation))
            if self.inline_judge and not (view.success_criteria or {}).get("rubric"):
                return self._judged_inline(row, result, llm, children)
            return outcome("judging", result=result, detail="result ready for judging")
        if isinstance(decision, Fail):
            return outcome("failed", error=decision.reason)
        if isinstance(decision, Escalate):
            return outcome("escalated", error=decision.reason)
        if isinstance(decision, Delegate):
            if view.phase == "aggregate":
                raise DelegationRefused("aggregate cannot delegate; use RetryChildren")
            if not decision.children:
                raise DelegationRefused("a delegation needs at least one child")
            violation = self.policies.validate_delegation(view, decision.children)
            if violation is not None:
                return outcome("escalated", error=str(violation))
            new_rows = self._carve(view, decision.children, llm)
            detail = decision.note or (
                f"delegated to {len(new_rows)} children: "
                + ", ".join(sorted({c.to_agent for c in new_rows}))
            )
            return DelegateAction(view.id, row.lease, new_rows, detail)
        if isinstance(decision, RetryChildren):
            if view.phase != "aggregate":
                raise DelegationRefused("RetryChildren is only valid from aggregate")
            if decision.reassign_to is not None:
                violation = self._check_reassignment(view, decision, children)
                if violation is not None:
                    return outcome("escalated", error=str(violation))
            _check_retry_budget(view, llm, decision.child_ids, children)
            what = (f"reassigned {len(decision.child_ids)} children to {decision.reassign_to}"
                    if decision.reassign_to else f"retried {len(decision.child_ids)} children")
            return RetryAction(view.id, row.lease, list(decision.child_ids),
                               decision.reassign_to, decision.note or what)
        raise TypeError(
            f"agent {cls.name!r} returned {type(decision).__name__}; expected Result, Delegate, "
            "Fail, Escalate or (from aggregate) RetryChildren"
        )

    def _check_reassignment(self, view: TaskView, decision: RetryChildren,
                            children: list[TaskRow]) -> Any:
        """A reassignment is a delegation to another agent: same checks as a delegation."""
        agent = str(decision.reassign_to)
        try:
            self.registry.get(agent)
        except UnknownAgent as exc:
            raise DelegationRefused(str(exc)) from None
        by_id = {c.id: c for c in children}
        specs = []
        for child_id in decision.child_ids:
            child = by_id.get(child_id)
            if child is None:
                raise DelegationRefused(f"{child_id} is not a child of {view.id}")
            try:
                self.registry.validate_input(agent, child.payload)
            except InvalidInput as exc:
                raise DelegationRefused(f"reassigning {child_id}: {exc}") from None
            specs.append(ChildSpec(agent=agent, payload=child.payload,
                                   key=child.idempotency_key or str(child_id),
                                   type=child.type))
        return self.policies.validate_delegation(view, specs)

    def _carve(self, parent: TaskView, specs: list[ChildSpec], llm: Any) -> list[ChildRow]:
        """Check the children; carve their budgets from what is left (budget rule 1)."""
        self._check_children(specs)
        left_tokens, left_usd = _left(parent, llm)
        try:
            grants = carve(left_tokens, left_usd, parent.budget_seconds,
                           [Ask(s.key, s.budget_tokens, s.budget_usd, s.budget_seconds)
                            for s in specs])
        except BudgetRefused as exc:
            raise DelegationRefused(str(exc)) from None
        return [
            ChildRow(
                to_agent=s.agent,
                type=s.type if s.type != "task" else self.registry.get(s.agent).types[0],
                payload=_jsonable(s.payload), key=s.key, budget_tokens=g.tokens,
                budget_seconds=g.seconds, budget_usd=g.usd, priority=s.priority,
                success_criteria=s.success_criteria, kill_criteria=s.kill_criteria)
            for s, g in zip(specs, grants, strict=True)
        ]

    def _check_children(self, specs: list[ChildSpec]) -> None:
        """Unique keys, known agents, valid payloads and criteria, or the delegation is refused."""
        keys = [s.key for s in specs]
        if len(set(keys)) != len(keys):
            raise DelegationRefused(f"child keys must be unique under a parent: {keys}")
        for spec in specs:
            try:
                self.registry.validate_input(spec.agent, spec.payload)
                validate_criteria(spec.success_criteria, spec.kill_criteria)
            except (UnknownAgent, InvalidInput, BadInput) as exc:
                raise DelegationRefused(f"child {spec.key!r}: {exc}") from None

    def _judged_inline(self, row: TaskRow, result: Any, llm: Any,
                       children: list[TaskRow]) -> RunOutcome:
        """Judge a fresh result in the worker that produced it (no model, no database)."""
        # Nothing to check: the rules judge accepts it, whatever the spend or the time
        # (judge_task's answer, without the snapshot it would read nothing from), and the
        # task goes straight to done: one event, not a pass through judging.
        nothing = self.judge is judge_task and not row.success_criteria and not row.kill_criteria
        if nothing:
            judgement = accepted()
        else:
            snapshot = self._judged_snapshot(row, result, llm)
            try:
                judgement = self.judge(snapshot, children, None, self.settings)
            except Exception as exc:
                return RunOutcome(row.id, row.lease, "escalated", result=result,
                                  error=f"judge error: {type(exc).__name__}: {exc}",
                                  verdict=undecided(f"the judge could not decide: {exc}"))
        why = " (no criteria to judge)" if nothing else ""
        return RunOutcome(row.id, row.lease, judgement.to_status, result=result,
                          error=judgement.error, verdict=judgement.verdict,
                          detail=f"verdict: {judgement.to_status}{why}", skips_judging=nothing)

    @staticmethod
    def _judged_snapshot(row: TaskRow, result: Any, llm: Any) -> TaskRow:
        """The row as the judge sees it: the fresh result, this run's spend and time."""
        snapshot = row.replace(result=result)
        budget = getattr(built_llm(llm), "budget", None)
        if isinstance(budget, TaskBudget):  # this run's spend too, not only the claim's
            snapshot.spent_tokens, snapshot.spent_usd = budget.spent_tokens, budget.spent_usd
        if row.claimed_at is not None:
            # Epoch seconds: subtracting datetimes of two time zones (the row's ZoneInfo,
            # dt.UTC) costs several microseconds a task in utcoffset calls.
            running = time.time() - row.claimed_at.timestamp()
            snapshot.duration_seconds = float(row.duration_seconds or 0) + running
        return snapshot

    # ------------------------------------------------------------------ judge stage
    def judge_one(self, row: TaskRow | dict[str, Any],
                  lease_lost: threading.Event) -> JudgeOutcome | Dropped:
        """Judge one leased ``judging`` task against its success and kill criteria."""
        row = _typed(row)
        kill = row.kill_criteria or {}
        try:
            children = self.store.claims.child_rows(row.id) if "max_child_failures" in kill else []
        except DATABASE_GONE as exc:
            return Dropped(row.id, f"judge interrupted: {type(exc).__name__}")
        llm = None
        if (row.success_criteria or {}).get("rubric"):
            llm = self.llm_factory.for_task(row, row.lease, lease_lost)
        try:
            judgement = self.judge(row, children, llm, self.settings)
        except JUDGE_INTERRUPTED as exc:
            # Leave it leased: the reaper hands it back to the judge stage.
            return Dropped(row.id, f"judge interrupted: {type(exc).__name__}")
        except Exception as exc:
            return JudgeOutcome(row.id, row.lease, "escalated",
                                undecided(f"the judge could not decide: {exc}"),
                                error=f"judge error: {type(exc).__name__}: {exc}")
        return JudgeOutcome(row.id, row.lease, judgement.to_status,
                            judgement.verdict, error=judgement.error,
                            detail=f"verdict: {judgement.to_status}")
