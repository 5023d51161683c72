"""What the model layer needs from the database, as a Protocol (no Store import here).

The wiring (:func:`runtime.wiring.build_runtime`) passes an implementation over the Store
(:class:`runtime.engine.ledger.StoreLedger`) to :class:`~runtime.llm.handle.LLMFactory`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from runtime.store.rows import ModelCharge, StepBegin, StepEnd, StepRecord


@dataclass(frozen=True)
class RecordedCall:
    """The recorded successful reply of one durable model call.

    Attributes:
        call_id: the ``model_calls`` row it was read from.
        request_hash: the hash of the request it answered.
        response: the reply text (JSON text for structured output).
        thinking: the thinking text kept beside it, if any.
        model / route / backend: where the reply came from.
        prompt_tokens / completion_tokens: what it cost when it was made.
        tool_calls: the tool calls the reply asked for, if any.

    """

    call_id: int
    request_hash: str
    response: str
    thinking: str | None
    model: str
    route: str
    backend: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: list[dict[str, Any]] | None = None


class CallLedger(Protocol):
    """The database side of model calls: queue depth, charging, and the record of replies."""

    def pending_depth(self) -> int:
        """How many tasks are pending (routing's queue-depth signal)."""
        ...

    def charge(self, charge: ModelCharge) -> bool:
        """Record one model call row and charge it to the task; False when the lease is lost."""
        ...

    def recorded_call(self, task_id: uuid.UUID, phase: str, position: str,
                      request_hashes: Sequence[str],
                      counterpart: uuid.UUID | None = None) -> RecordedCall | None:
        """The recorded successful reply at this position for one of these request hashes.

        Several hashes because the route (and so the model in the request) may differ from
        one delivery to the next: the request is hashed once per candidate model. A task
        of a fork's branch names its ``counterpart`` (the task it re-runs): the
        counterpart's reply at the same position answers when the task has none itself.
        """
        ...


class StepLedger(Protocol):
    """The database side of durable steps: their start and their result, fenced by the lease."""

    def step_begin(self, begin: StepBegin) -> StepRecord | None:
        """Record a step as started, or return its finished record; None: lease lost."""
        ...

    def step_finish(self, end: StepEnd) -> bool:
        """Record a step's result or error and charge its cost; False: lease lost."""
        ...

    def tool_approval(self, task_id: uuid.UUID, lease_token: uuid.UUID, phase: str,
                      call_id: str, tool: str, args_hash: str, args: str) -> str | None:
        """A tool call's decision (``approved``/``denied``) or ``asked`` now; None: lease lost."""
        ...


async def write_begin(ledger: Any, begin: StepBegin,
                      in_thread: Callable[..., Awaitable[Any]] = asyncio.to_thread
                      ) -> StepRecord | None:
    """A step's begin write: ``astep_begin`` on this loop, else ``step_begin`` in a thread.

    The thread is ``in_thread`` (the ledger has no async begin: a test's ledger, say).
    """
    abegin = getattr(ledger, "astep_begin", None)
    if abegin is not None:
        record: StepRecord | None = await abegin(begin)
        return record
    began: StepRecord | None = await in_thread(ledger.step_begin, begin)
    return began


async def write_finish(ledger: Any, end: StepEnd,
                       in_thread: Callable[..., Awaitable[Any]] = asyncio.to_thread) -> bool:
    """A step's finish write, as :func:`write_begin`."""
    afinish = getattr(ledger, "astep_finish", None)
    if afinish is not None:
        return bool(await afinish(end))
    return bool(await in_thread(ledger.step_finish, end))


class BranchSteps:
    """The steps of a fork's branch task: its counterpart's record answers repeated steps.

    A step (``ctx.step``, a tool call) that the counterpart finished at the same place
    (phase, position, name) with the same arguments is served from the counterpart's
    result without running, and recorded on the branch task as replayed: a re-run pays
    for side effects only where they changed. Any other step begins as usual (a changed
    argument runs the step). A ledger without ``step_from_counterpart`` serves nothing.

    Args:
        ledger: the model layer's step ledger.
        counterpart: the task the branch task re-runs (its ``forked_from``).

    """

    def __init__(self, ledger: StepLedger, counterpart: uuid.UUID) -> None:
        self._ledger = ledger
        self._counterpart = counterpart
        self._from_counterpart = getattr(ledger, "step_from_counterpart", None)

    def step_begin(self, begin: StepBegin) -> StepRecord | None:
        """The counterpart's finished step, recorded as this task's; else a usual begin."""
        if self._from_counterpart is not None:
            record: StepRecord | None = self._from_counterpart(begin, self._counterpart)
            if record is not None:
                return record
        return self._ledger.step_begin(begin)

    def step_finish(self, end: StepEnd) -> bool:
        """As the ledger's."""
        return self._ledger.step_finish(end)

    async def astep_begin(self, begin: StepBegin) -> StepRecord | None:
        """:meth:`step_begin` from a coroutine (the ledger's async begin when it has one)."""
        if self._from_counterpart is not None:
            record: StepRecord | None = await asyncio.to_thread(
                self._from_counterpart, begin, self._counterpart)
            if record is not None:
                return record
        return await write_begin(self._ledger, begin)

    async def astep_finish(self, end: StepEnd) -> bool:
        """:meth:`step_finish` from a coroutine, as the ledger's."""
        return await write_finish(self._ledger, end)

    def tool_approval(self, task_id: uuid.UUID, lease_token: uuid.UUID, phase: str,
                      call_id: str, tool: str, args_hash: str, args: str) -> str | None:
        """``approved`` without asking when the counterpart finished this call; else ask.

        The call (same place, tool and arguments) will be served from the counterpart's
        record by :meth:`step_begin` and never run: there is no side effect to approve.
        """
        finished = getattr(self._ledger, "step_finished_at", None)
        if finished is not None and finished(self._counterpart, phase, call_id, tool,
                                             args_hash):
            return "approved"
        return self._ledger.tool_approval(task_id, lease_token, phase, call_id, tool,
                                          args_hash, args)


def step_ledger(ledger: Any, counterpart: uuid.UUID | None) -> Any:
    """The ledger a task's steps use: :class:`BranchSteps` for a fork's branch task."""
    return ledger if counterpart is None else BranchSteps(ledger, counterpart)


@dataclass(frozen=True)
class RecordLookup:
    """One durable call's look-up: the task, phase, position, hashes (and counterpart)."""

    task_id: uuid.UUID
    phase: str
    position: str
    hashes: tuple[str, ...]
    counterpart: uuid.UUID | None = None


class RecordReader:
    """Looks recorded replies up, batching the look-ups that arrive together.

    A re-run (a fork's branch) of a thousand-task tree asks for a thousand records at
    once; one read per call would be a thousand statements and thread hops. When the
    ledger offers ``recorded_calls`` (a batched read), the look-ups that arrive while a
    read is in flight share the next read, per event loop (as the start gate's reads do),
    awaited on the loop when it offers ``arecorded_calls`` too (no thread hop); without
    it, each look-up is one ``recorded_call``.

    Args:
        ledger: the model layer's ledger.
        off_loop: runs a blocking ledger read off the event loop.

    """

    def __init__(self, ledger: Any, off_loop: Any) -> None:
        self._ledger = ledger
        self._off_loop = off_loop
        self._batched = getattr(ledger, "recorded_calls", None)
        #: The batched read as a coroutine (the loop's own connection), when offered.
        self._abatched = getattr(ledger, "arecorded_calls", None)
        self._waiting: dict[asyncio.AbstractEventLoop,
                            list[tuple[RecordLookup, asyncio.Future[RecordedCall | None]]]] = {}
        self._reading: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}

    async def read(self, task_id: uuid.UUID, phase: str, position: str,
                   hashes: Sequence[str],
                   counterpart: uuid.UUID | None = None) -> RecordedCall | None:
        """The recorded reply for one call (see :meth:`CallLedger.recorded_call`)."""
        if self._batched is None:
            args: tuple[Any, ...] = (task_id, phase, position, list(hashes))
            if counterpart is not None:
                args = (*args, counterpart)
            result: RecordedCall | None = await self._off_loop(self._ledger.recorded_call,
                                                               *args)
            return result
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
                lookups = [lk for lk, _ in batch]
                try:
                    found = (await self._abatched(lookups) if self._abatched is not None
                             else await self._off_loop(self._batched, lookups))
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
