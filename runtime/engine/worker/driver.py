"""The :class:`Worker`: puts the pieces together; :meth:`Worker.run` drives them on a loop.

:meth:`Worker.run` runs one event loop: the scheduler (claims, one coroutine per task, the
writer, maintenance), the lease keeper's heartbeat, and, in a daemon thread, the
notification listener. The step API (:meth:`Worker.run_once`, :meth:`Worker.claim_batch`,
:meth:`Worker.execute`, :meth:`Worker.apply`, :meth:`Worker.heartbeat_once`,
:meth:`Worker.maintain_once`) steps the same code by hand, in the caller's thread.

Model calls run on the worker's loop too: an async agent's ``await ctx.llm.acomplete``
directly, a sync agent's or the judge's ``complete`` submitted from its thread (the worker
attaches its loop to the model layer and detaches it, closing its model connections, when
it ends). SIGKILL loses nothing: the worker's liveness session ends with the process and
any live worker takes its tasks back within about a second
(:mod:`~runtime.engine.worker.liveness`); where PostgreSQL cannot see the death (a host
cut off), the leases expire and the reaper hands the tasks back.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from runtime.engine.actions import Action
from runtime.engine.executor import Executor
from runtime.engine.maintenance import Maintenance
from runtime.engine.worker.agent_threads import SyncAgentRunner
from runtime.engine.worker.db_steps import Steps
from runtime.engine.worker.leases import LeaseKeeper
from runtime.engine.worker.listener import Listener, NotifierFactory
from runtime.engine.worker.liveness import Liveness
from runtime.engine.worker.scheduler import Scheduler
from runtime.engine.worker.settings import JUDGE, WorkerConfig, WorkerStats
from runtime.engine.worker.state import DbHealth, Held, InFlight, Wake
from runtime.engine.worker.stopper import CANCEL_NOTE, PAUSE_NOTE, StopWatcher
from runtime.store.notify import TaskChannel
from runtime.store.store import Store

T = TypeVar("T")


class Worker:
    """Claims, executes and completes tasks for a set of agents.

    Args:
        store: the database.
        executor: turns a claimed task into an action.
        config: how the worker runs.
        notifier: opens a subscription to the task channel (default: the store's
            :class:`~runtime.store.notify.TaskChannel`).

    Attributes:
        held: the tasks held (claimed, outcome not yet written).
        leases: the heartbeat (:meth:`LeaseKeeper.on_lost` to hear of tasks taken away).
        liveness: the session PostgreSQL sees die, and the dead-owner pass.
        scheduler: the claim loop, the dispatch and the writer.
        listener: the notification listener (None when ``listen`` is off).

    """

    def __init__(self, store: Store, executor: Executor, config: WorkerConfig,
                 notifier: NotifierFactory | None = None) -> None:
        self.store = store
        self.executor = executor
        self.config = config
        executor.inline_judge = config.judges
        self.stats = WorkerStats()
        self._stopping = threading.Event()
        self.held = Held()
        self.wake = Wake()
        health = DbHealth(self.stats)
        self.steps = Steps(store, config, self.stats)
        # Parked sync agents free room to claim: the claim loop hears of it.
        threads = config.worker.sync_threads
        self.agents = SyncAgentRunner(executor, threads,
                                      config.worker.max_in_flight + threads, self.wake)
        self.leases = LeaseKeeper(store, self.held, config.worker.lease_seconds, health)
        self.liveness = Liveness(store, config, self.stats, health)
        self.scheduler = Scheduler(self.steps, self.agents, config, self.held, self.wake,
                                   health, self._stopping, self.stop)
        # Cancelled tasks stop within a second: polled, and poked by the heartbeat (a lease
        # gone) and by the cancel's notification.
        self.stopper = StopWatcher(store, self.held, executor.llm_factory.gate, health)
        self.leases.on_lost(lambda _lost: self.stopper.poke())
        self.listener: Listener | None = None
        if config.listen:
            self.listener = Listener(notifier or (lambda: TaskChannel.open(store.engine)),
                                     config.notifications | {CANCEL_NOTE, PAUSE_NOTE},
                                     self._noted,
                                     self.wake, self._stopping)

    @property
    def maintenance(self) -> Maintenance:
        """The combined reaper, watchdog and sweeper pass."""
        return self.steps.maintenance

    # ------------------------------------------------------------------ control
    def stop(self, reason: str = "stopped", now: bool = False) -> None:
        """Stop claiming; in-flight work finishes (or is released) and ``run`` returns.

        ``now`` cuts the stop grace short: what is still in flight is handed back to the
        queue at once (the CLI's second SIGTERM or Ctrl-C). Safe from any thread and from
        a signal handler.
        """
        if now:
            self.scheduler.hurry.set()
        if not self._stopping.is_set():
            self.stats.stop_reason = self.stats.stop_reason or reason
            self._stopping.set()
        self.wake()

    @property
    def stopping(self) -> bool:
        """True once ``stop`` was called or an exit condition was reached."""
        return self._stopping.is_set()

    def _noted(self, payload: str) -> None:
        """A notification for this worker: wake the claim loop (and the judge's claims)."""
        if payload in (CANCEL_NOTE, PAUSE_NOTE):
            # Model calls whose gate read was in flight read again (it may predate this).
            refresh = getattr(self.stopper.gate, "refresh", None)
            if refresh is not None:
                refresh()
            if payload == CANCEL_NOTE:
                self.stopper.poke()
            return
        if payload == JUDGE:
            self.steps.judging_may_wait.set()
        self.wake.announce()

    # ------------------------------------------------------------------ the step API
    def claim_batch(self, capacity: int) -> list[InFlight]:
        """Claim up to ``capacity`` tasks (run and judge stage, alternating priority)."""
        return self.steps.claim_batch(capacity)

    def execute(self, item: InFlight) -> Action:
        """Run the agent or the judge for one claimed task, in this thread."""
        return self.agents.execute(item)

    def apply(self, actions: list[Action]) -> None:
        """Write a list of actions: batched outcomes, then delegations and retries."""
        self.steps.apply(actions)

    def run_once(self) -> int:
        """Claim one batch, work it as the loop would, write the outcomes; return its size.

        The dispatcher's :meth:`~Dispatcher.step` on a loop of its own, with the agent
        runner inline (sync agents run in this thread). Used by tests and by anything that
        wants to step the runtime by hand.
        """
        self.steps.judging_may_wait.set()  # stepping by hand: always look at both queues
        items = self.steps.claim_batch(self.config.worker.batch_size)
        if items:
            self.steps.apply(run_to_end(self.scheduler.dispatch.step(items)))
        return len(items)

    def heartbeat_once(self) -> int:
        """Extend every lease held; flag tasks whose lease was lost. Returns how many held."""
        return self.leases.beat_once()

    def maintain_once(self) -> bool:
        """One pass of the reaper, the watchdog and the fan-in sweeper; False when skipped."""
        return self.steps.maintain_once()

    # ------------------------------------------------------------------ the loop
    def run(self) -> WorkerStats:
        """Work until stopped, the task cap, the wall clock, or (``once``) an empty queue."""
        asyncio.run(self._main())
        return self.stats

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        # Sync agents' and the judge's model calls run on this loop too (async agents'
        # calls already do): one set of per-server limits, no second loop thread.
        self.executor.llm_factory.attach(loop)
        self.wake.bind(loop, woken=self._stopping.is_set())
        # The first threads start now: a thread started on demand in the middle of a burst
        # blocks the thread that starts it until it runs (a few ms, waiting for the GIL),
        # so more are started only by a thread parking on a model call, never by the loop.
        self.agents.start()
        self.leases.start()
        if self.listener is not None:
            self.listener.start()
        beat = loop.create_task(self.leases.run(), name="heartbeat")
        stops = loop.create_task(self.stopper.run(), name="stop-check")
        self.liveness.start()
        live = None
        try:
            # Before the first claim: what dead workers left is taken back, then this
            # incarnation registers (its lock is how PostgreSQL sees it die).
            await self.liveness.begin()
            live = loop.create_task(self.liveness.run(), name="liveness")
            await self.scheduler.run()
        finally:
            self._stopping.set()
            background = [beat, stops] + ([live] if live is not None else [])
            for job in background:
                job.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.executor.llm_factory.detach()
            self.leases.close()
            self.liveness.close()  # after the drain: the session ends, the lock with it
            self.wake.unbind()


def run_to_end(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a loop of its own and return its result.

    In a thread that already runs an event loop (a test driven by Playwright, a notebook)
    ``asyncio.run`` refuses to start, so the coroutine gets a short-lived thread of its own.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-once") as pool:
        return pool.submit(asyncio.run, coro).result()
