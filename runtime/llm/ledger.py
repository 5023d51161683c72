"""What the model layer needs from the database, as one Protocol (no Store import here).

:class:`CallLedger` declares every method the model layer calls on it: the queue depth
(routing), the tenants' token buckets (:mod:`runtime.llm.token_meter`), the start gate's
read (:mod:`runtime.llm.gate`), the charges, the record of replies, and durable steps
(:class:`StepLedger`, with a fork's branch task served from its counterpart's). The
records passed are in :mod:`runtime.records`, shared with the store. The wiring
(:func:`runtime.wiring.build_runtime`) passes the implementation over the Store
(:class:`runtime.engine.store_ledger.StoreLedger`) to :class:`~runtime.llm.handle.LLMFactory`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Protocol

from runtime.llm.gate import GateState
from runtime.records import (
    ModelCharge,
    RecordedCall,
    RecordLookup,
    StepBegin,
    StepEnd,
    StepRecord,
)


class StepLedger(Protocol):
    """The database side of durable steps: their start and their result, fenced by the lease."""

    def step_begin(self, begin: StepBegin) -> StepRecord | None:
        """Record a step as started, or return its finished record; None: lease lost."""
        ...

    def step_finish(self, end: StepEnd) -> bool:
        """Record a step's result or error and charge its cost; False: lease lost."""
        ...

    async def astep_begin(self, begin: StepBegin) -> StepRecord | None:
        """:meth:`step_begin` from a coroutine (on the running loop's own connection)."""
        ...

    async def astep_finish(self, end: StepEnd) -> bool:
        """:meth:`step_finish` from a coroutine (on the running loop's own connection)."""
        ...

    def tool_approval(self, task_id: uuid.UUID, lease_token: uuid.UUID, phase: str,
                      call_id: str, tool: str, args_hash: str, args: str) -> str | None:
        """A tool call's decision (``approved``/``denied``) or ``asked`` now; None: lease lost."""
        ...


class CallLedger(StepLedger, Protocol):
    """The database side of model calls: everything the model layer asks of it."""

    def pending_depth(self) -> int:
        """How many tasks are pending (routing's queue-depth signal)."""
        ...

    def charges_url(self) -> str | None:
        """The database another process may charge calls in (the recorder process's).

        None: this ledger's charges are written in this process only.
        """
        ...

    def take_tokens(self, tenant: str, need: float, rate: float, refund: float) -> float:
        """A tenant's token bucket: 0 when ``need`` was taken, else the seconds to wait."""
        ...

    def gate_calls(self, task_ids: Sequence[uuid.UUID]
                   ) -> tuple[dict[uuid.UUID, GateState], Callable[[], None]]:
        """The start gate's read: each task's status, its tree paused, its lease holder.

        Read under the trees' steering locks, held until the returned ``release()``.
        """
        ...

    def charge(self, charge: ModelCharge) -> bool:
        """Record one model call row and charge it to the task; False when the lease is lost."""
        ...

    async def acharge(self, charge: ModelCharge) -> bool:
        """:meth:`charge` from a coroutine (awaits its batch without holding a thread)."""
        ...

    def submit_charge(self, charge: ModelCharge,
                      loop: asyncio.AbstractEventLoop) -> asyncio.Future[bool]:
        """Queue :meth:`charge` at once, from any thread; its outcome as a future on ``loop``.

        The row is on its way to the database when this returns (a reply recorded on
        arrival); ``loop``'s coroutine awaits the outcome.
        """
        ...

    async def amark_failed(self, charge: ModelCharge, error: str) -> bool:
        """Give the recorded row of ``charge`` its error; False when the lease is gone."""
        ...

    async def arecorded_calls(self, lookups: Sequence[RecordLookup]
                              ) -> list[RecordedCall | None]:
        """The recorded successful reply of each look-up, in order (one statement).

        A look-up names several hashes because the route (and so the model in the
        request) may differ from one delivery to the next: the request is hashed once per
        candidate model. A look-up of a fork's branch task names its ``counterpart`` (the
        task it re-runs): the counterpart's reply at the same position answers when the
        task has none itself.
        """
        ...

    async def aadopt_replies(self, tasks: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> int:
        """Adopt the journaled replies of ``tasks`` (id, lease token) never charged.

        The replies an earlier delivery's recorder journaled on arrival whose charge never
        committed (the recorder died with the worker) become recorded, charged calls of
        the task under the given lease, exactly once (:mod:`runtime.store.call_replies`);
        returns how many.
        """
        ...

    def step_from_counterpart(self, begin: StepBegin,
                              counterpart: uuid.UUID) -> StepRecord | None:
        """A fork's branch task's step served from its counterpart's record, or None."""
        ...

    def step_finished_at(self, task_id: uuid.UUID, phase: str, position: str, name: str,
                         args_hash: str) -> bool:
        """Whether ``task_id`` finished that step with those arguments (a counterpart's)."""
        ...

    async def aclose(self) -> None:
        """Close the running loop's own connections (before the loop ends)."""
        ...


class BranchSteps:
    """The steps of a fork's branch task: its counterpart's record answers repeated steps.

    A step (``ctx.step``, a tool call) that the counterpart finished at the same place
    (phase, position, name) with the same arguments is served from the counterpart's
    result without running, and recorded on the branch task as replayed: a re-run pays
    for side effects only where they changed. Any other step begins as usual (a changed
    argument runs the step).

    Args:
        ledger: the model layer's ledger.
        counterpart: the task the branch task re-runs (its ``forked_from``).

    """

    def __init__(self, ledger: CallLedger, counterpart: uuid.UUID) -> None:
        self._ledger = ledger
        self._counterpart = counterpart

    def step_begin(self, begin: StepBegin) -> StepRecord | None:
        """The counterpart's finished step, recorded as this task's; else a usual begin."""
        record = self._ledger.step_from_counterpart(begin, self._counterpart)
        return record if record is not None else self._ledger.step_begin(begin)

    def step_finish(self, end: StepEnd) -> bool:
        """As the ledger's."""
        return self._ledger.step_finish(end)

    async def astep_begin(self, begin: StepBegin) -> StepRecord | None:
        """:meth:`step_begin` from a coroutine (the counterpart's read in a thread)."""
        record = await asyncio.to_thread(self._ledger.step_from_counterpart, begin,
                                         self._counterpart)
        return record if record is not None else await self._ledger.astep_begin(begin)

    async def astep_finish(self, end: StepEnd) -> bool:
        """:meth:`step_finish` from a coroutine, as the ledger's."""
        return await self._ledger.astep_finish(end)

    def tool_approval(self, task_id: uuid.UUID, lease_token: uuid.UUID, phase: str,
                      call_id: str, tool: str, args_hash: str, args: str) -> str | None:
        """``approved`` without asking when the counterpart finished this call; else ask.

        The call (same place, tool and arguments) will be served from the counterpart's
        record by :meth:`step_begin` and never run: there is no side effect to approve.
        """
        if self._ledger.step_finished_at(self._counterpart, phase, call_id, tool, args_hash):
            return "approved"
        return self._ledger.tool_approval(task_id, lease_token, phase, call_id, tool,
                                          args_hash, args)


def step_ledger(ledger: CallLedger, counterpart: uuid.UUID | None) -> StepLedger:
    """The ledger a task's steps use: :class:`BranchSteps` for a fork's branch task."""
    return ledger if counterpart is None else BranchSteps(ledger, counterpart)


class RecordReader:
    """Looks recorded replies up, batching the look-ups that arrive together.

    A re-run (a fork's branch) of a thousand-task tree asks for a thousand records at
    once; one read per call would be a thousand statements. The look-ups that arrive
    while a read is in flight share the next read (the ledger's ``arecorded_calls``, on
    the loop's own connection), per event loop, as the start gate's reads do.

    Args:
        ledger: the model layer's ledger.

    """

    def __init__(self, ledger: CallLedger) -> None:
        self._ledger = ledger
        self._waiting: dict[asyncio.AbstractEventLoop,
                            list[tuple[RecordLookup, asyncio.Future[RecordedCall | None]]]] = {}
        self._reading: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}
        self._adopting: dict[asyncio.AbstractEventLoop,
                             list[tuple[tuple[uuid.UUID, uuid.UUID], asyncio.Future[None]]]] = {}
        self._adopters: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}

    async def adopt(self, task_id: uuid.UUID, lease_token: uuid.UUID) -> None:
        """Adopt the task's journaled replies (:meth:`CallLedger.aadopt_replies`), batched.

        The adoptions asked for while one is written share the next statement, as the
        look-ups do (a restarted worker takes hundreds of tasks back at once).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._adopting.setdefault(loop, []).append(((task_id, lease_token), future))
        if loop not in self._adopters:
            self._adopters[loop] = loop.create_task(self._adopt_batches(loop))
        await future

    async def _adopt_batches(self, loop: asyncio.AbstractEventLoop) -> None:
        """Write the waiting adoptions, batch after batch, until nobody waits."""
        try:
            await asyncio.sleep(0)  # the adoptions asked for in this turn of the loop join
            while self._adopting.get(loop):
                batch = self._adopting.pop(loop)
                try:
                    await self._ledger.aadopt_replies([task for task, _ in batch])
                except Exception as exc:  # each caller sees the database's error
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for _, future in batch:
                    if not future.done():
                        future.set_result(None)
        finally:
            self._adopters.pop(loop, None)

    async def read(self, task_id: uuid.UUID, phase: str, position: str,
                   hashes: Sequence[str],
                   counterpart: uuid.UUID | None = None) -> RecordedCall | None:
        """The recorded reply for one call (see :meth:`CallLedger.arecorded_calls`)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RecordedCall | None] = loop.create_future()
        lookup = RecordLookup(task_id, phase, position, tuple(hashes), counterpart)
        self._waiting.setdefault(loop, []).append((lookup, future))
        if loop not in self._reading:
            self._reading[loop] = loop.create_task(self._read_batches(loop))
        return await future

    async def _read_batches(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the waiting look-ups, batch after batch, until nobody waits."""
        try:
            while self._waiting.get(loop):
                batch = self._waiting.pop(loop)
                try:
                    found = await self._ledger.arecorded_calls([lk for lk, _ in batch])
                except Exception as exc:  # each caller sees the database's error
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), record in zip(batch, found, strict=True):
                    if not future.done():
                        future.set_result(record)
        finally:
            self._reading.pop(loop, None)
