"""The async scheduler: claims what there is room for, works on each task, writes.

On the worker's one event loop:

- **the claim loop** claims batches (``FOR UPDATE SKIP LOCKED``, several claims of
  ``batch_size`` at once when there is room) for at most :attr:`Scheduler.limit` tasks
  held at once. It wakes on a notification, on room freed, and polls every
  ``poll_interval_seconds`` as a fallback (a room smaller than the claim threshold is
  filled at the next poll);
- **the work of each task** (:class:`~runtime.engine.worker.dispatch.Dispatcher`, started
  and stopped with the loop): an ``async def``
  agent is awaited on the loop (its model calls run in parallel), one coroutine per task;
  a sync agent and the judge run in the
  :class:`~runtime.engine.worker.agent_threads.SyncAgentRunner`'s threads, their futures
  handing the actions on;
- **the writer**: actions that arrive within :data:`WRITE_WINDOW_SECONDS` are written
  together (:meth:`~runtime.engine.worker.db_steps.Steps.apply`); a task stays held (and
  heartbeated) until its outcome is written;
- **maintenance**: one pass of reaper, watchdog and sweeper per interval across workers.

Blocking database calls run in :data:`DB_THREADS` threads, off the loop. The step API
(``Worker.run_once``) drives :meth:`Dispatcher.step <runtime.engine.worker.dispatch.
Dispatcher.step>`: the same ``action_for``, with the agent runner inline.

Failure modes: a database error in the claims, the writer or maintenance is counted,
logged once per streak and retried with backoff. Outcomes that could not be written are
kept and written again; if the lease expired meanwhile, the write matches nothing and the
task runs again elsewhere. On stop, in-flight work gets ``stop_grace_seconds`` to finish
and be written; the rest is released back to the queue. Tasks whose model calls wait for
their tenant's tokens are released at once, and :attr:`Scheduler.hurry` (a second signal)
ends the grace.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from runtime.core import backoff
from runtime.engine.actions import Action
from runtime.engine.threads import ThreadRunner
from runtime.engine.worker.agent_threads import SyncAgentRunner, serves_async_agents
from runtime.engine.worker.db_steps import Steps
from runtime.engine.worker.dispatch import Dispatcher
from runtime.engine.worker.settings import (
    CLAIMS_AT_ONCE,
    DB_ERRORS,
    DB_RETRY_MAX_SECONDS,
    DB_THREADS,
    HOLD_AHEAD_SECONDS,
    SYNC_PREFETCH,
    WRITE_WINDOW_SECONDS,
    WorkerConfig,
)
from runtime.engine.worker.state import DbHealth, Held, InFlight, Pace, Wake
from runtime.store.postgres import failover
from runtime.store.rows import Handoff

log = logging.getLogger(__name__)

T = TypeVar("T")


class Scheduler:
    """Claims, dispatches and writes on one event loop (see the module doc)."""

    def __init__(self, steps: Steps, agents: SyncAgentRunner, config: WorkerConfig,
                 held: Held, wake: Wake, health: DbHealth, stopping: threading.Event,
                 stop: Callable[[str], None]) -> None:
        self.steps = steps
        self.agents = agents
        self.executor = agents.executor
        self.config = config
        self.held = held
        self.wake = wake
        self.health = health
        self.stopping = stopping
        #: Set to end the stop grace at once: what is in flight is handed back.
        self.hurry = threading.Event()
        self.stop = stop
        self.async_agents = serves_async_agents(self.executor, config.run_agents)
        #: Works each claimed task to its action (started and stopped by :meth:`run`).
        self.dispatch = Dispatcher(self.executor, agents, held, self.async_agents)
        self._db_threads: ThreadRunner | None = None
        self._queue: asyncio.Queue[InFlight] | None = None
        self.pace = Pace()

    # ------------------------------------------------------------------ room
    @property
    def limit(self) -> int:
        """Most tasks this process holds at once.

        ``max_in_flight``; when every agent served is a sync one, also no more than
        :data:`SYNC_PREFETCH` per sync thread, parked ones included (an agent parked on
        a model call has its thread replaced), plus what the worker finishes in
        :data:`HOLD_AHEAD_SECONDS` at its pace over the last second. Sync work runs at
        most ``threads`` at once besides those parked; the extra tasks wait in memory,
        not a claim round trip away, when a thread frees (the claim of the next batch
        overlaps the work of this one). So a sync worker whose agents wait on models
        holds as many tasks as the calls in flight allow; one whose agents are slow
        holds few (a task it holds waits about a quarter second for a thread, not
        longer, while other workers may be idle); one whose agents are quick holds
        enough to keep its threads busy across a claim and a write (Little's law: held =
        rate x time held).
        """
        cfg = self.config
        if self.async_agents:
            return cfg.worker.max_in_flight
        ahead = int(self.pace.per_second() * HOLD_AHEAD_SECONDS)
        return min(cfg.worker.max_in_flight,
                   (cfg.worker.sync_threads + self.agents.parked) * SYNC_PREFETCH + ahead)

    def room(self, announced: bool = False) -> int:
        """How many more tasks this process may claim now (by the model slots, once used)."""
        # One round of slots ahead of the calls running; a round more when new work was
        # announced (it comes first in fair order), at most 8 rounds held (operations.md).
        room, (slots, waiting) = self.limit - len(self.held), self._model_pressure()
        if not slots:
            return room
        free = max(2 * slots - waiting, min(slots, 8 * slots - len(self.held)) if announced else 0)
        return min(room, max(0, free))

    def _model_pressure(self) -> tuple[int, int]:
        """``(slots, waiting)`` of the model calls on this loop (``(0, 0)``: none made)."""
        return self.executor.llm_factory.calls.pressure(asyncio.get_running_loop())

    def _claim_size(self, room: int) -> int:
        """The most one round of claims asks for: several batches at once with room."""
        if self.config.task_cap is not None:
            # one claim at a time keeps the cap exact
            return min(room, self.config.worker.batch_size)
        return min(room, self.config.worker.batch_size * CLAIMS_AT_ONCE)

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Claim, work and write until stopped; then drain, release, and stop the threads."""
        self._db_threads = ThreadRunner(DB_THREADS, "db")
        self._queue = self.dispatch.start()
        loop = asyncio.get_running_loop()
        background = [loop.create_task(self._writer_loop(), name="writer")]
        if self.config.maintenance:
            background.append(loop.create_task(self._maintenance_loop(), name="maintenance"))
        try:
            await self._claim_loop()
        finally:
            self.stopping.set()
            await self._drain()
            self.dispatch.stop()
            for job in background:
                job.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self.agents.shutdown()
            self._db_threads.shutdown(wait=True)

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking database call off the loop."""
        assert self._db_threads is not None
        return await self._db_threads.run(fn, *args)

    def _must_stop(self, started: float) -> bool:
        cfg = self.config
        if cfg.wall_clock_seconds is not None and \
                time.monotonic() - started >= cfg.wall_clock_seconds:
            self.stop("wall clock reached")
        if cfg.task_cap is not None and self.steps.stats.claimed >= cfg.task_cap:
            self.stop("task cap reached")
        return self.stopping.is_set()

    async def _claim_loop(self) -> None:
        cfg = self.config
        started = time.monotonic()
        threshold = max(1, min(cfg.worker.batch_size, self.limit // 2))
        delays = backoff.delays(0.1, DB_RETRY_MAX_SECONDS)
        polled = False  # the last wait ended at the poll interval, not on a wake-up
        while not self._must_stop(started):
            room = self.room(self.wake.take_announced())
            # Claim when enough room is free (or nothing is held): fewer, larger claims.
            # A smaller room is filled at the next poll, so it never stays empty while
            # work waits (a gap left by tasks that ended one by one, say).
            items: list[InFlight] = []
            need = 1 if self._model_pressure()[0] else threshold  # room(): by model slots
            if room > 0 and (room >= need or not self.held or polled):
                try:
                    items = await self._claim(room)
                    self.health.ok("claims")
                    delays = backoff.delays(0.1, DB_RETRY_MAX_SECONDS)
                except DB_ERRORS as exc:
                    self.health.error("claims", exc)
                    await self.wake.sleep(next(delays))
                    continue
            for item in items:
                self.dispatch.submit(item)
            if items and len(items) >= min(room, self._claim_size(room)) and self.room() > 0:
                # The queue had more than we took: claim again at once. The claim goes to
                # a database thread before the tasks just started take the loop, so the
                # next batch is on its way while they start (no sleep(0) between).
                continue
            if cfg.once and not items and not self.held:
                self.stop("queue empty")
                return
            polled = not await self.wake.sleep(cfg.worker.poll_interval_seconds)
            if polled:
                self.steps.judging_may_wait.set()  # the polling fallback covers judging too

    async def _claim(self, room: int) -> list[InFlight]:
        """Claim up to ``room`` tasks: concurrent claims of ``batch_size`` (SKIP LOCKED)."""
        size, batch = self._claim_size(room), self.config.worker.batch_size
        sizes = [min(batch, size - n) for n in range(0, size, batch)]
        if len(sizes) == 1:
            return await self._db(self.steps.claim_batch, sizes[0])
        claimed = await asyncio.gather(*(self._db(self.steps.claim_batch, n) for n in sizes),
                                       return_exceptions=True)
        items = [i for c in claimed if isinstance(c, list) for i in c]
        errors = [c for c in claimed if isinstance(c, BaseException)]
        if errors and not items:
            raise errors[0]
        for error in errors:  # what the other claims got still runs
            self.health.error("claims", error)
        return items

    async def _writer_loop(self) -> None:
        """Write what arrives within a few milliseconds together; retry on database errors.

        The window is waited only while other held tasks are still being worked on (what
        could join the batch): a lone outcome, as each level of a chain, is written at
        once. The work the write hands to this worker (:meth:`_handoff`) starts as soon
        as it committed; the claim loop is woken only when the write freed room.
        """
        assert self._queue is not None
        queue = self._queue
        while True:
            batch = [await queue.get()]
            if len(self.held) > len(batch) + queue.qsize():
                await asyncio.sleep(WRITE_WINDOW_SECONDS)
            while not queue.empty():
                batch.append(queue.get_nowait())
            handed = await self._write([i.action for i in batch if i.action is not None],
                                       self._handoff(len(batch)))
            self.held.remove(batch)
            self.pace.note(len(batch))
            if handed < len(batch):
                self.wake()

    def _handoff(self, freed: int) -> Handoff | None:
        """The room offered to the writes of a batch of ``freed`` tasks (None: none).

        What the claim loop would claim once the batch is written: its room (the batch's
        tasks freed), at most one round of claims, within a task cap; nothing while
        stopping.
        """
        cfg = self.config
        if self.stopping.is_set() or not cfg.run_agents:
            return None
        room = self._claim_size(max(0, self.room() + freed))
        if cfg.task_cap is not None:
            room = min(room, cfg.task_cap - self.steps.stats.claimed)
        return Handoff(cfg.run_agents, room, cfg.worker.lease_seconds) if room > 0 else None

    def _run_handed(self, handoff: Handoff | None) -> int:
        """Start the work the writes leased to this worker; return how many tasks."""
        rows = handoff.take_all() if handoff is not None else []
        if rows:
            self.steps.count_claimed(len(rows))
            for row in rows:
                self.dispatch.submit(InFlight(row, "run"))
        return len(rows)

    async def _write(self, actions: list[Action], handoff: Handoff | None = None) -> int:
        """Write ``actions`` (retrying); return how many tasks they handed to this worker."""
        delays, handed = backoff.delays(0.1, DB_RETRY_MAX_SECONDS), 0
        while True:
            try:
                await self._db(self.steps.apply, actions, handoff)
                self.health.ok("writer")
                return handed + self._run_handed(handoff)
            except DB_ERRORS as exc:
                # What a transaction that committed handed over is this worker's: run it.
                handed += self._run_handed(handoff)
                self.health.error("writer", exc)
                if failover.in_doubt(exc):
                    # The retry below is the check: every write is guarded by its lease
                    # token, so what already landed matches nothing and changes nothing.
                    log.warning(f"the COMMIT of {len(actions)} outcome(s) was in doubt; "
                                "writing them again (those already recorded are refused by "
                                "their lease tokens, logged as late writes)")
                await asyncio.sleep(next(delays))

    async def _maintenance_loop(self) -> None:
        interval = self.config.worker.maintenance_interval_seconds
        while not self.stopping.is_set():
            await asyncio.sleep(interval)
            try:
                await self._db(self.steps.maintain_once)
                self.health.ok("maintenance")
            except DB_ERRORS as exc:
                self.health.error("maintenance", exc)

    async def _drain(self) -> None:
        """Let in-flight work finish and be written within the grace, then release the rest.

        A task whose model call waits for its tenant's tokens is released at once: a dry
        bucket can outlast the grace, and where the task runs next its calls so far are
        replayed, not paid again.
        """
        deadline = time.monotonic() + self.config.worker.stop_grace_seconds
        while self.held and time.monotonic() < deadline and not self.hurry.is_set():
            await self._let_go(self.held.take(self._waiting_for_tokens()))
            await self.wake.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        await self._let_go(self.held.take_all())

    def _waiting_for_tokens(self) -> set[Any]:
        """The tasks whose model calls wait for their tenant's token bucket now."""
        meter = self.executor.llm_factory.calls.meter
        return meter.waiting_tasks() if meter is not None else set()

    async def _let_go(self, items: list[InFlight]) -> None:
        """Stop the work on ``items`` (no longer held) and hand their tasks back to the queue."""
        for item in items:
            item.lease_lost.set()
            if item.job is not None:
                item.job.cancel()
        tokens = [i.row.lease_token for i in items if i.row.lease_token is not None]
        for attempt in range(5):
            if not tokens:
                break
            try:
                self.steps.stats.released += await self._db(
                    self.steps.store.claims.release, tokens, self.config.worker_id)
                break
            except DB_ERRORS as exc:
                self.health.error("release", exc)
                await asyncio.sleep(0.2 * (attempt + 1))
