"""How a held task is worked on: one path from the claim to the writer's queue.

:class:`Dispatcher`, held by the :class:`~runtime.engine.worker.scheduler.Scheduler`:

- an ``async def`` agent is awaited on the loop, one asyncio task per task
  (:meth:`Dispatcher.action_for`);
- a sync agent and the judge run in the agent threads; the thread's future is the task's
  ``job`` and a callback hands its action to the writer (:meth:`Dispatcher._settled`): no
  coroutine and no asyncio task per task. Cancelling the future (``InFlight.abort``)
  ends the task as ``Dropped`` at once, as cancelling an asyncio task does; the agent's
  thread runs to its end and its result is ignored.

Its lifecycle: :meth:`~Dispatcher.start` on the worker's loop (it returns the writer's
queue), :meth:`~Dispatcher.submit` for each task claimed, :meth:`~Dispatcher.stop` once
the scheduler has drained what it held (an agent thread that ends later hands nothing
on). The step API (``Worker.run_once``) needs none of it: :meth:`Dispatcher.step` runs
the same :meth:`Dispatcher.action_for`, with the agent runner inline.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from runtime.engine.actions import Action, Dropped
from runtime.engine.executor import Executor
from runtime.engine.worker.agent_threads import SyncAgentRunner
from runtime.engine.worker.state import Held, InFlight
from runtime.store.rows import RunOutcome

log = logging.getLogger(__name__)


class Dispatcher:
    """Runs held tasks to their actions and queues them for the writer (see the module doc).

    Args:
        executor: runs one task (``aexecute`` on the loop for async agents).
        agents: the agent threads (sync agents and the judge).
        held: the tasks the worker holds; a submitted task is added to it.
        async_agents: whether any agent served is an ``async def`` one.

    """

    def __init__(self, executor: Executor, agents: SyncAgentRunner, held: Held,
                 async_agents: bool) -> None:
        self.executor = executor
        self.agents = agents
        self.held = held
        self.async_agents = async_agents
        self._queue: asyncio.Queue[InFlight] | None = None

    def start(self) -> asyncio.Queue[InFlight]:
        """Begin on the running loop; return the queue the actions arrive on."""
        self._queue = asyncio.Queue()
        return self._queue

    def stop(self) -> None:
        """End: what finishes from now on (a thread past the stop grace) is not queued."""
        self._queue = None

    def _on_loop(self, item: InFlight) -> bool:
        """Whether the task's agent is an ``async def`` one, awaited on the loop."""
        return item.kind == "run" and self.async_agents and self.executor.is_async(item.row)

    async def action_for(self, item: InFlight) -> Action:
        """Run one held task to its action: the one path, for the loop and the step API."""
        try:
            if self._on_loop(item):
                return await self.executor.aexecute(item.row, item.lease_lost,
                                                    self.agents.blocking)
            return await self.agents.run(item)
        except Exception as exc:  # the executor catches agent errors; this is a bug
            return self._crashed(item, exc)

    @staticmethod
    def _crashed(item: InFlight, exc: BaseException) -> Action:
        log.error("executor crashed", exc_info=exc, extra={"task_id": str(item.row.id)})
        return RunOutcome(item.row.id, item.row.lease, "failed", error=f"runtime error: {exc}")

    async def step(self, items: list[InFlight]) -> list[Action]:
        """The actions of ``items``, worked on together (the step API's pass)."""
        return list(await asyncio.gather(*(self.action_for(i) for i in items)))

    def submit(self, item: InFlight) -> None:
        """Hold ``item`` and start its work; its action will arrive on the queue."""
        self.held.add(item)
        if not self._on_loop(item):
            # A sync agent or the judge: the thread's future is the task's job, its
            # action handed on by a callback (no coroutine, no asyncio task per task).
            future = self.agents.submit(item)
            if future is not None:
                item.job = future
                future.add_done_callback(functools.partial(self._settled, item))
                return
        item.job = asyncio.get_running_loop().create_task(self._work(item))

    def _settled(self, item: InFlight, future: asyncio.Future[Action]) -> None:
        """A sync task's thread ended (or its future was cancelled): hand on its action."""
        if self._queue is None:
            return  # stopped: the task was handed back already
        if future.cancelled():
            if item.abort_reason is None:
                return  # the worker is stopping: the task is released, not written
            action: Action = Dropped(item.row.id, item.abort_reason)
        elif (exc := future.exception()) is not None:
            action = self._crashed(item, exc)
        else:
            action = future.result()
        item.action = action
        self._queue.put_nowait(item)

    async def _work(self, item: InFlight) -> None:
        """Run one task to its action and hand the action to the writer."""
        try:
            action = await self.action_for(item)
        except asyncio.CancelledError:
            if item.abort_reason is None:
                raise  # the worker is stopping: the task is released, not written
            action = Dropped(item.row.id, item.abort_reason)
        item.action = action
        if self._queue is not None:  # else stopped: the task was handed back already
            self._queue.put_nowait(item)
