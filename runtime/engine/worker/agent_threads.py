"""The thread side of a worker: sync agents and the judge stage run in a bounded set of threads.

A sync ``run``/``aggregate`` and the judge block; they run in ``sync_threads`` threads
(:class:`~runtime.engine.threads.ThreadRunner`: results come back to the loop one wake-up
per batch). An async agent's blocking steps (the children's read) run there too, off the
loop.

Before :meth:`SyncAgentRunner.start` (and after :meth:`SyncAgentRunner.shutdown`) the
runner is *inline*: every call runs in the calling thread. That is how the step API
(``Worker.run_once``) drives the same code as the scheduler without threads.

Failure modes: an exception from the executor propagates to the awaiting coroutine (the
scheduler turns it into a failed outcome); a sync agent cannot be interrupted: a task
aborted while it runs has its thread run to the end and its result ignored.
"""

from __future__ import annotations

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
        except Exception:  # an unknown agent fails its tasks; it is not async
            continue
        if inspect.iscoroutinefunction(cls.run) or inspect.iscoroutinefunction(cls.aggregate):
            return True
    return False


class SyncAgentRunner:
    """Runs sync agents and the judge for held tasks, in threads once started.

    Args:
        executor: turns a claimed task into its action.
        threads: how many sync agents (or judges) run at once.

    """

    def __init__(self, executor: Executor, threads: int) -> None:
        self.executor = executor
        self.threads = threads
        self._runner: ThreadRunner | None = None

    def execute(self, item: InFlight) -> Action:
        """Run the agent or the judge for one held task, in this thread (blocking)."""
        if item.kind == "judge":
            return self.executor.judge_one(item.row, item.lease_lost)
        return self.executor.execute(item.row, item.lease_lost)

    async def run(self, item: InFlight) -> Action:
        """:meth:`execute` in one of the threads (inline before :meth:`start`)."""
        return await self.blocking(self.execute, item)

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call in one of the threads (inline before :meth:`start`)."""
        runner = self._runner
        if runner is None:
            return fn(*args)
        return await runner.run(fn, *args)

    def start(self) -> None:
        """Start the threads (all at once: one started mid-burst would block the loop)."""
        if self._runner is None:
            self._runner = ThreadRunner(self.threads, "agent")

    def shutdown(self) -> None:
        """Stop the threads without waiting; calls not yet started are dropped."""
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.shutdown(wait=False, cancel_pending=True)
