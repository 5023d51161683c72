"""The thread side of a worker: sync agents and the judge stage run in an elastic set of threads.

A sync ``run``/``aggregate`` and the judge block; they run in threads
(:class:`~runtime.engine.threads.ThreadRunner`: results come back to the loop one wake-up
per batch). ``sync_threads`` threads are free to run Python at any time: a thread whose
agent waits on a model call (``ctx.llm.complete`` hands the call to the worker's loop and
*parks* the thread) is replaced by a new one, and leaves the pool when its task ends, so
the pool grows with the calls in flight, up to ``max_threads`` (the worker's
``max_in_flight`` plus ``sync_threads``). An async agent's blocking steps (the
children's read) run there too, off the loop.

Before :meth:`SyncAgentRunner.start` (and after :meth:`SyncAgentRunner.shutdown`) the
runner is *inline*: every call runs in the calling thread. That is how the step API
(``Worker.run_once``) drives the same code as the scheduler without threads.

Failure modes: an exception from the executor propagates to the awaiting coroutine (the
scheduler turns it into a failed outcome); a sync agent cannot be interrupted: a task
aborted while it runs has its thread run to the end and its result ignored.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from runtime.engine.actions import Action
from runtime.engine.executor import Executor
from runtime.engine.threads import ThreadRunner
from runtime.engine.worker.state import InFlight

T = TypeVar("T")


def serves_async_agents(executor: Executor, agents: list[str]) -> bool:
    """Whether any of ``agents`` has an ``async def`` run or aggregate."""
    registry = getattr(executor, "registry", None)
    if registry is None:
        return False
    for name in agents:
        try:
            cls = registry.get(name)
        except LookupError:  # an unknown agent (UnknownAgent) fails its tasks; not async
            continue
        if inspect.iscoroutinefunction(cls.run) or inspect.iscoroutinefunction(cls.aggregate):
            return True
    return False


class SyncAgentRunner:
    """Runs sync agents and the judge for held tasks, in threads once started.

    Args:
        executor: turns a claimed task into its action.
        threads: how many sync agents (or judges) run Python at once (not counting
            those parked on a model call).
        max_threads: the most threads, parked included (``threads`` or fewer: a fixed pool).
        on_park: called (from the parking thread) when an agent parks on a model call.

    """

    def __init__(self, executor: Executor, threads: int, max_threads: int | None = None,
                 on_park: Callable[[], None] | None = None) -> None:
        self.executor = executor
        self.threads = threads
        self.max_threads = max_threads or threads
        self.on_park = on_park
        self._runner: ThreadRunner | None = None

    @property
    def parked(self) -> int:
        """Agents (or judges) waiting on a model call right now."""
        runner = self._runner
        return runner.parked if runner is not None else 0

    def execute(self, item: InFlight) -> Action:
        """Run the agent or the judge for one held task, in this thread (blocking)."""
        if item.kind == "judge":
            return self.executor.judge_one(item.row, item.lease_lost)
        return self.executor.execute(item.row, item.lease_lost)

    async def run(self, item: InFlight) -> Action:
        """:meth:`execute` in one of the threads (inline before :meth:`start`)."""
        return await self.blocking(self.execute, item)

    def submit(self, item: InFlight) -> asyncio.Future[Action] | None:
        """:meth:`execute` in one of the threads, as a future; None before :meth:`start`."""
        runner = self._runner
        return None if runner is None else runner.submit(self.execute, item)

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call in one of the threads (inline before :meth:`start`)."""
        runner = self._runner
        if runner is None:
            return fn(*args)
        return await runner.run(fn, *args)

    def start(self) -> None:
        """Start the threads (all at once: one started mid-burst would block the loop)."""
        if self._runner is None:
            self._runner = ThreadRunner(self.threads, "agent", self.max_threads,
                                        on_park=self.on_park)

    def shutdown(self) -> None:
        """Stop the threads without waiting; calls not yet started are dropped."""
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.shutdown(wait=False, cancel_pending=True)
