"""Durable steps of one task: ``ctx.step`` / ``ctx.astep``, and each tool call of a tool loop.

A step runs a side-effecting function at most once per task as far as the record can
tell, and returns the same result on every delivery:

1. **Identity.** The task, its phase (``run``, ``aggregate``), the step's position (order
   of issue in this delivery's phase; a tool call's is its model call's position, round
   and index) and its name; the arguments' sha256 tells a changed call from a repeat.
2. **Begin.** The step is recorded ``started`` before the function runs (fenced by the
   lease token). When an earlier delivery recorded it ``finished`` with the same
   arguments, its result is returned now, without running (a *replay*, counted on the
   row). A row found ``started`` (its worker died inside it) or ``failed`` runs again; the
   row's ``starts`` says how often it started.
3. **Run.** The function gets a stable idempotency key (``agents.tools.idempotency_key()``,
   or a keyword parameter named ``idempotency_key``): an external system can deduplicate
   the request a crashed delivery may already have sent. A :class:`~agents.tools.RetryPolicy`
   retries transient errors with backoff. Past the task's deadline (``budget_seconds``
   from the claim) a step does not start, and an ``async`` one is cancelled.
4. **Finish.** The JSON result (or the error) is recorded, fenced by the lease: a late
   worker's result is not recorded and it gets :class:`~runtime.errors.LeaseLost`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import inspect
import json
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from agents.tools import RetryPolicy, reset_step_key, set_step_key
from runtime.core.canonical import canonical_json, sha256_hex
from runtime.errors import BudgetExceeded, LeaseLost
from runtime.llm.ledger import StepLedger
from runtime.records import StepBegin, StepEnd, StepRecord

#: How much of a step's arguments its row keeps (the hash covers all of them).
ARGS_DISPLAY_CHARS = 2000


class StepBudget(Protocol):
    """What a step needs from the task's budget (``runtime.budget.TaskBudget``)."""

    def reserve_usd(self, usd: Decimal, what: str) -> Any:
        """Hold a tool's cost before it runs; raises BudgetExceeded if it does not fit."""
        ...

    def settle(self, held: Any, tokens: int = 0, usd: Decimal = Decimal(0)) -> Any:
        """Release a reservation and add what was charged."""
        ...


@dataclass(frozen=True)
class StepResult:
    """What a step came to.

    Attributes:
        value: the function's JSON result (as read back from JSON), or None on error.
        error: ``Type: message`` when the function raised (after its retries).
        exception: that exception (None when replayed or fine).
        replayed: True when served from the record without running.
        idempotency_key: the step's stable key.
        starts: how often this step started, over all deliveries.
        tries: calls of the function in this run (1 + retries; 0 when replayed).
        duration_seconds: how long it ran (0 when replayed).
        step_id: its ``task_steps`` row.
        recorded: with ``run(..., defer_finish=True)``, the write of its result still in
            flight (await it: raises :class:`LeaseLost` when it was not recorded); None
            when the result is already recorded (or was served from the record).

    """

    value: Any
    error: str | None
    exception: BaseException | None
    replayed: bool
    idempotency_key: str
    starts: int
    tries: int
    duration_seconds: float
    step_id: int
    recorded: asyncio.Future[None] | None = None


def _json_result(value: Any, name: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"step {name!r} returned a value that is not JSON-serialisable: "
                        f"{exc}") from None


def _wants_key(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes an ``idempotency_key`` (cached: a signature costs ~0.1 ms)."""
    try:
        return _wants_key_cached(fn)
    except TypeError:  # not hashable
        return _takes_key(fn)


@functools.lru_cache(maxsize=1024)
def _wants_key_cached(fn: Callable[..., Any]) -> bool:
    return _takes_key(fn)


def _takes_key(fn: Callable[..., Any]) -> bool:
    try:
        return "idempotency_key" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _deadline_of(task_row: Any) -> float | None:
    deadline = task_row.get("deadline_at") if hasattr(task_row, "get") else None
    return deadline.timestamp() if isinstance(deadline, dt.datetime) else None


class TaskSteps:
    """The durable steps of one leased task (``ctx.step`` / ``ctx.astep`` and tool calls).

    Args:
        ledger: the database side (:class:`~runtime.llm.ledger.StepLedger`).
        task_row: the claimed task (id, phase, delivery count, deadline).
        lease_token: the claim's fencing token.
        lease_lost: set by the worker's heartbeat when the task was taken away.
        in_ledger: runs a blocking ledger call off the loop (default: a thread).
        budget: the task's budget, for tools that cost money (optional).

    """

    def __init__(self, ledger: StepLedger, task_row: Any, lease_token: uuid.UUID,
                 lease_lost: threading.Event,
                 in_ledger: Callable[..., Awaitable[Any]] | None = None,
                 budget: StepBudget | None = None) -> None:
        self._ledger = ledger
        self.task_id: uuid.UUID = task_row["id"]
        self.phase = ("judge" if task_row.get("status") == "judging"
                      else str(task_row.get("phase") or "run"))
        self._attempt = int(task_row.get("delivery_count") or 1)
        self._token = lease_token
        self._lease_lost = lease_lost
        self._deadline = _deadline_of(task_row)
        self._in_ledger = in_ledger or asyncio.to_thread
        self.budget = budget
        self._count = 0
        self._lock = threading.Lock()

    def next_position(self) -> str:
        """The next step's position: its order of issue in this delivery's phase."""
        with self._lock:
            position = str(self._count)
            self._count += 1
        return position

    # ------------------------------------------------------------------ public
    def step(self, name: str, fn: Callable[..., Any], *args: Any,
             retry: RetryPolicy | None = None, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` as a durable step from synchronous code.

        Returns its JSON result (read back from JSON, also the first time); raises what
        it raised (recorded as the step's error), :class:`LeaseLost` when the task was
        taken away, :class:`BudgetExceeded` past the task's ``budget_seconds``.
        """
        begin = self.begin_of(name, args, kwargs, self.next_position())
        record = self._started(self._ledger.step_begin(begin), begin)
        if record.replayed:
            return record.result
        started, tries, value, error = time.monotonic(), 0, None, None
        while True:
            tries += 1
            token = set_step_key(record.idempotency_key)
            try:
                out = fn(*args, **self._with_key(fn, kwargs, record))
                value = asyncio.run(out) if inspect.iscoroutine(out) else out
                value = _json_result(value, name)
                break
            except Exception as exc:
                if not self._retrying(exc, retry, tries):
                    error = exc
                    break
            finally:
                reset_step_key(token)
            time.sleep(retry.delay(tries) if retry else 0)
        end = self._end_of(record, value, error, tries, time.monotonic() - started)
        if not self._ledger.step_finish(end):
            raise self._lost(name, "its result was not recorded")
        if error is not None:
            raise error
        return value

    async def astep(self, name: str, fn: Callable[..., Any], *args: Any,
                    retry: RetryPolicy | None = None, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` as a durable step from a coroutine (see :meth:`step`).

        An ``async`` function is awaited on the caller's loop; a plain one runs in a
        thread. Several steps may run at once (``asyncio.gather``): each takes its
        position when it is issued.
        """
        outcome = await self.run(name, fn, args, kwargs, position=self.next_position(),
                                 retry=retry)
        if outcome.exception is not None:
            raise outcome.exception
        return outcome.value

    async def run(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any], *, position: str, kind: str = "step",
                  tool_call_id: str | None = None, retry: RetryPolicy | None = None,
                  cost_usd: Decimal = Decimal(0), defer_finish: bool = False) -> StepResult:
        """Run one step at ``position``; its error is returned, not raised.

        With ``defer_finish`` the result is returned as soon as the function returned, and
        its (fenced, durable) record is written meanwhile: the caller awaits
        :attr:`StepResult.recorded` before it relies on the record (the tool loop: after
        the next model call, which the record's round trip overlaps).

        Raises only what ends the task's delivery: :class:`LeaseLost`,
        :class:`BudgetExceeded` (no time, or no money for ``cost_usd``).
        """
        begin = self.begin_of(name, args, kwargs, position, kind, tool_call_id)
        record = self._started(await self._write_begin(begin), begin)
        if record.replayed:
            return StepResult(record.result, None, None, True, record.idempotency_key,
                              record.starts, 0, 0.0, record.step_id)
        held = (self.budget.reserve_usd(cost_usd, f"tool {name!r}")
                if cost_usd and self.budget is not None else None)
        started = time.monotonic()
        try:
            value, error, tries = await self._attempts(name, fn, args, kwargs, record, retry)
        except BaseException:
            if held is not None and self.budget is not None:
                self.budget.settle(held, 0, Decimal(0))
            raise
        end = self._end_of(record, value, error, tries, time.monotonic() - started, cost_usd)
        finishing = self._finish(name, end, held)
        recorded = asyncio.ensure_future(finishing) if defer_finish else None
        if recorded is None:
            await finishing
        return StepResult(value, end.error, error, False, record.idempotency_key,
                          record.starts, tries, end.duration_seconds, record.step_id, recorded)

    async def _finish(self, name: str, end: StepEnd, held: Any) -> None:
        """Record a step's end (fenced, durable) and settle its cost's reservation."""
        charged = Decimal(0)
        try:
            if not await self._write_finish(end):
                raise self._lost(name, "its result was not recorded")
            charged = end.cost_usd
        finally:
            if held is not None and self.budget is not None:
                self.budget.settle(held, 0, charged)

    async def approval(self, call_id: str, tool: str, kwargs: dict[str, Any]) -> str:
        """A person's decision on one tool call: ``approved``, ``denied``, or ``asked``.

        The call is named exactly: the task, phase, call id (its step's position), tool and
        the hash of its validated arguments (its step's). With no decision yet the ask is
        recorded (``asked``: the caller holds the task). Raises :class:`LeaseLost`.
        """
        begin = self.begin_of(tool, (), kwargs, call_id, "tool", call_id)
        status: str | None = await self._in_ledger(
            self._ledger.tool_approval, self.task_id, self._token, self.phase, call_id, tool,
            begin.args_hash, begin.args)
        if status is None:
            raise self._lost(tool, "its approval was not asked for")
        return status

    # ------------------------------------------------------------------ parts
    async def _write_begin(self, begin: StepBegin) -> StepRecord | None:
        """The begin write, awaited on this loop (the ledger's own connection)."""
        return await self._ledger.astep_begin(begin)

    async def _write_finish(self, end: StepEnd) -> bool:
        """The finish write (durable), as :meth:`_write_begin`."""
        return await self._ledger.astep_finish(end)

    async def _attempts(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                        kwargs: dict[str, Any], record: StepRecord,
                        retry: RetryPolicy | None) -> tuple[Any, BaseException | None, int]:
        tries = 0
        call_kwargs = self._with_key(fn, kwargs, record)
        while True:
            tries += 1
            token = set_step_key(record.idempotency_key)
            try:
                if inspect.iscoroutinefunction(fn):
                    value = await self._bounded(fn(*args, **call_kwargs), name)
                else:
                    value = await asyncio.to_thread(fn, *args, **call_kwargs)
                    if inspect.isawaitable(value):
                        value = await self._bounded(value, name)
                return _json_result(value, name), None, tries
            except (LeaseLost, BudgetExceeded):
                raise
            except Exception as exc:
                if not self._retrying(exc, retry, tries):
                    return None, exc, tries
            finally:
                reset_step_key(token)
            await asyncio.sleep(retry.delay(tries) if retry else 0)

    async def _bounded(self, awaitable: Awaitable[Any], name: str) -> Any:
        """Await a step's coroutine, cancelled at the task's deadline (``budget_seconds``)."""
        if self._deadline is None:
            return await awaitable
        left = max(0.0, self._deadline - time.time())
        try:
            async with asyncio.timeout(left) as scope:
                return await awaitable
        except TimeoutError:
            if scope.expired():
                raise BudgetExceeded(f"budget: step {name!r} of task {self.task_id} was "
                                     "stopped at the task's budget_seconds") from None
            raise

    def _retrying(self, exc: Exception, retry: RetryPolicy | None, tries: int) -> bool:
        return (retry is not None and isinstance(exc, retry.on) and tries < retry.attempts
                and not self._lease_lost.is_set()
                and (self._deadline is None
                     or time.time() + retry.delay(tries) < self._deadline))

    def begin_of(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                  position: str, kind: str = "step",
                  tool_call_id: str | None = None) -> StepBegin:
        """The start a step ``name`` at ``position`` records, its idempotency key in it.

        Raises:
            ValueError: an empty name.
            LeaseLost: the task was taken away.
            BudgetExceeded: the task is past its ``budget_seconds``.

        """
        if not isinstance(name, str) or not name.strip():
            raise ValueError("a step needs a non-empty name")
        if self._lease_lost.is_set():
            raise self._lost(name, "it did not run")
        if self._deadline is not None and time.time() >= self._deadline:
            raise BudgetExceeded(f"budget: step {name!r} refused for task {self.task_id}: "
                                 "the task is past its budget_seconds")
        payload = canonical_json({"args": list(args), "kwargs": kwargs})  # stored: durable
        digest = sha256_hex(payload)
        key = f"{self.task_id}/{self.phase}/{position}/{name}/{digest[:12]}"
        return StepBegin(self.task_id, self._token, self.phase, position, name,
                         payload[:ARGS_DISPLAY_CHARS], digest, key, self._attempt, kind,
                         tool_call_id)

    def _started(self, record: StepRecord | None, begin: StepBegin) -> StepRecord:
        if record is None:
            raise self._lost(begin.name, "it did not run")
        return record

    def _end_of(self, record: StepRecord, value: Any, error: BaseException | None, tries: int,
                duration: float, cost_usd: Decimal = Decimal(0)) -> StepEnd:
        message = None if error is None else f"{type(error).__name__}: {error}"
        return StepEnd(self.task_id, self._token, record.step_id, record.starts,
                       None if error else value, message, tries, duration, cost_usd)

    @staticmethod
    def _with_key(fn: Callable[..., Any], kwargs: dict[str, Any],
                  record: StepRecord) -> dict[str, Any]:
        if "idempotency_key" not in kwargs and _wants_key(fn):
            return {**kwargs, "idempotency_key": record.idempotency_key}
        return kwargs

    def _lost(self, name: str, what: str) -> LeaseLost:
        return LeaseLost(f"task {self.task_id}: lease lost; step {name!r}: {what}")
