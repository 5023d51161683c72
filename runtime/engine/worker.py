"""``orgchart worker``: claims tasks, runs agents and the judge, writes the outcomes.

One event loop per worker process (:meth:`Worker.run`). On it run:

- **the claim loop**: claims batches (``FOR UPDATE SKIP LOCKED``) for what there is room
  for: at most ``max_in_flight`` tasks held at once (claimed and not yet written), and,
  when every agent served is a sync one, no more than four per ``sync_threads`` thread.
  It wakes on LISTEN/NOTIFY (``orgchart_tasks``; the payload is the agent name, ``judge``
  for the judge stage; a listener thread), on room freed, and polls every
  ``poll_interval_seconds`` as a fallback (a room smaller than a claim batch is filled
  at the next poll);
- **one coroutine per task in flight**: an ``async def run/aggregate`` agent is awaited on
  the loop (its ``ctx.llm`` calls can run in parallel); a sync agent and the judge stage
  run in a bounded set of threads (``sync_threads``; results come back to the loop in
  batches, :mod:`runtime.engine.threads`);
- **the writer**: actions that arrive within :data:`WRITE_WINDOW_SECONDS` are written
  together: one statement for all run outcomes, one for all verdicts (each row guarded by
  status and lease token, each transition its event in the same statement; a row the
  database refuses fails alone), then the delegations. A task stays held (and
  heartbeated) until its outcome is written;
- **the heartbeat** (every third of ``lease_seconds``: extends every lease held in one
  statement and flags the tasks whose lease was taken away) and **maintenance** (reaper,
  watchdog and fan-in sweeper: one pass per ``maintenance_interval_seconds`` across all
  workers, see :class:`runtime.engine.maintenance.Maintenance`).

Blocking database calls run in a small thread pool (:data:`DB_THREADS`), off the loop.
Model calls run on this loop too: an async agent's ``await ctx.llm.acomplete`` directly,
a sync agent's or the judge's ``complete`` submitted from its thread (the worker attaches
its loop to the model layer, :class:`runtime.llm.loop.CallLoop`, and detaches it, closing
its model connections, when it ends).

Options (``WorkerConfig``): agents, max in flight, sync threads, batch size, lease, task
cap, wall clock, ``once`` (exit when the queue is empty). It stops on ``stop()``
(SIGTERM/SIGINT in the CLI): no more claims, in-flight work gets ``stop_grace_seconds`` to
finish and be written, whatever is left is released back to the queue.

Failure modes: a database error (a dropped connection, a pool timeout, a server restart)
in any coroutine is logged once per streak, counted and retried with backoff; the
heartbeat never dies of one. Outcomes that could not be written are kept and written
again; if the lease expired meanwhile, the write matches nothing and the task runs again
elsewhere (at-least-once execution, exactly-once outcome). SIGKILL loses nothing: the
leases expire and the reaper hands the tasks back.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
import sqlalchemy as sa

from runtime.engine.executor import Action, DelegateAction, Dropped, Executor, RetryAction
from runtime.engine.maintenance import Maintenance, MaintenanceConfig
from runtime.engine.threads import ThreadRunner
from runtime.store.db import create_db_engine, libpq_url
from runtime.store.rows import JudgeOutcome, RunOutcome, TaskRow
from runtime.store.store import Store

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "orgchart_tasks"
JUDGE = "judge"
DB_RETRY_MAX_SECONDS = 5.0
STOP_GRACE_SECONDS = 10.0
#: How long the writer waits for more actions before it writes a batch.
WRITE_WINDOW_SECONDS = 0.003
#: Threads that run the blocking database calls (claims, writes, heartbeats, maintenance).
DB_THREADS = 4
#: Claims of ``batch_size`` sent at once when there is room for more (without a task cap).
CLAIMS_AT_ONCE = 3
#: Tasks held per sync thread when every agent served is a sync one (see ``_limit``).
SYNC_PREFETCH = 4
#: Errors that mean "the database is unreachable or busy right now": retried, never fatal.
DB_ERRORS: tuple[type[Exception], ...] = (sa.exc.DBAPIError, sa.exc.TimeoutError,
                                          psycopg.Error)

T = TypeVar("T")


def new_worker_id() -> str:
    """``host:pid:random`` so leases name who holds them."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerConfig:
    """How one worker runs; validated on creation."""

    agents: tuple[str, ...]
    worker_id: str = field(default_factory=new_worker_id)
    #: Threads for sync agents (the old name of ``sync_threads``; wins when given).
    concurrency: int | None = None
    max_in_flight: int = 1000
    sync_threads: int = 32
    batch_size: int = 50
    lease_seconds: float = 30.0
    poll_interval_seconds: float = 1.0
    maintenance_interval_seconds: float = 1.0
    task_cap: int | None = None
    wall_clock_seconds: float | None = None
    once: bool = False
    max_delivery: int = 3
    maintenance: bool = True
    listen: bool = True
    stop_grace_seconds: float = STOP_GRACE_SECONDS

    def __post_init__(self) -> None:
        if not self.agents:
            raise ValueError("a worker needs at least one agent to serve")
        if self.threads < 1 or self.batch_size < 1 or self.max_in_flight < 1:
            raise ValueError("sync_threads, max_in_flight and batch_size must be at least 1")
        if self.lease_seconds <= 0 or self.poll_interval_seconds <= 0:
            raise ValueError("lease_seconds and poll_interval_seconds must be positive")
        if self.task_cap is not None and self.task_cap < 1:
            raise ValueError("task_cap must be at least 1")
        if self.wall_clock_seconds is not None and self.wall_clock_seconds <= 0:
            raise ValueError("wall_clock_seconds must be positive")

    @property
    def threads(self) -> int:
        """Threads that run sync agents and the judge stage."""
        return self.concurrency if self.concurrency is not None else self.sync_threads

    @property
    def run_agents(self) -> list[str]:
        """Agents whose pending tasks this worker claims (``judge`` means the judge stage)."""
        return [a for a in self.agents if a != JUDGE]

    @property
    def judges(self) -> bool:
        """Whether this worker runs the judge stage."""
        return JUDGE in self.agents


@dataclass
class WorkerStats:
    """What a worker did; printed by ``orgchart worker`` and counted by fires."""

    claimed: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    delegated: int = 0
    retried_children: int = 0
    stale: int = 0
    dropped: int = 0
    released: int = 0
    reaped: int = 0
    poisoned: int = 0
    timed_out: int = 0
    swept: int = 0
    db_errors: int = 0
    stop_reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        return {
            "claimed": self.claimed, "outcomes": dict(self.outcomes),
            "delegated": self.delegated, "retried_children": self.retried_children,
            "stale": self.stale, "dropped": self.dropped, "released": self.released,
            "reaped": self.reaped, "poisoned": self.poisoned, "timed_out": self.timed_out,
            "swept": self.swept, "db_errors": self.db_errors, "stop_reason": self.stop_reason,
        }


@dataclass(eq=False)
class _InFlight:
    """One held task: its row, its stage, its lease flag, and (once done) its action."""

    row: TaskRow
    kind: str  # "run" or "judge"
    lease_lost: threading.Event
    action: Action | None = None
    job: asyncio.Task[None] | None = None


class Worker:
    """Claims, executes and completes tasks for a set of agents."""

    def __init__(self, store: Store, executor: Executor, config: WorkerConfig) -> None:
        self.store = store
        self.executor = executor
        self.config = config
        executor.inline_judge = config.judges
        self.stats = WorkerStats()
        self._stopping = threading.Event()
        self._judging_may_wait = threading.Event()
        self._judging_may_wait.set()
        self._inflight: dict[int, _InFlight] = {}
        self._inflight_lock = threading.Lock()
        self._judge_first = False
        self._claim_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_event: asyncio.Event | None = None
        self._db_threads: ThreadRunner | None = None
        self._agent_threads: ThreadRunner | None = None
        self._beat_thread: ThreadRunner | None = None
        self._beat_store: Store | None = None
        self._failing: set[str] = set()
        self._async_agents = self._served_async_agents()
        self.maintenance = Maintenance(store, MaintenanceConfig(
            max_delivery=config.max_delivery,
            interval_seconds=config.maintenance_interval_seconds))

    # ------------------------------------------------------------------ control
    def stop(self, reason: str = "stopped") -> None:
        """Stop claiming; in-flight work finishes (or is released) and ``run`` returns.

        Safe from any thread and from a signal handler.
        """
        if not self._stopping.is_set():
            self.stats.stop_reason = self.stats.stop_reason or reason
            self._stopping.set()
            self._wake()

    def _wake(self) -> None:
        """Wake the claim loop (from any thread)."""
        loop, event = self._loop, self._wake_event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(event.set)

    def _served_async_agents(self) -> bool:
        """Whether any agent this worker serves has an ``async def`` run or aggregate."""
        registry = getattr(self.executor, "registry", None)
        if registry is None:
            return False
        for name in self.config.run_agents:
            try:
                cls = registry.get(name)
            except Exception:  # an unknown agent fails its tasks; it is not async
                continue
            if inspect.iscoroutinefunction(cls.run) or \
                    inspect.iscoroutinefunction(cls.aggregate):
                return True
        return False

    @property
    def stopping(self) -> bool:
        """True once ``stop`` was called or an exit condition was reached."""
        return self._stopping.is_set()

    # ------------------------------------------------------------------ one pass
    def claim_batch(self, capacity: int) -> list[_InFlight]:
        """Claim up to ``capacity`` tasks (run and judge stage, alternating priority)."""
        cfg = self.config
        if cfg.task_cap is not None:
            capacity = min(capacity, cfg.task_cap - self.stats.claimed)
        capacity = min(capacity, cfg.batch_size)
        if capacity <= 0:
            return []
        with self._claim_lock:
            order = ["judge", "run"] if self._judge_first else ["run", "judge"]
            self._judge_first = not self._judge_first
        claimed: list[_InFlight] = []
        for kind in order:
            room = capacity - len(claimed)
            if room <= 0:
                break
            if kind == "run" and cfg.run_agents:
                rows = self.store.claim(cfg.run_agents, room, cfg.worker_id, cfg.lease_seconds)
            elif kind == "judge" and cfg.judges and self._judging_may_wait.is_set():
                rows = self.store.claim_judging(room, cfg.worker_id, cfg.lease_seconds)
                if len(rows) < room:
                    # Nothing more waits for the judge (results are mostly judged inline):
                    # skip this round trip until a 'judge' notification or the next poll.
                    self._judging_may_wait.clear()
            else:
                continue
            claimed += [_InFlight(row, kind, threading.Event()) for row in rows]
        with self._claim_lock:
            self.stats.claimed += len(claimed)
        return claimed

    def execute(self, item: _InFlight) -> Action:
        """Run the agent or the judge for one claimed task."""
        if item.kind == "judge":
            return self.executor.judge_one(item.row, item.lease_lost)
        return self.executor.execute(item.row, item.lease_lost)

    def apply(self, actions: list[Action]) -> None:
        """Write a list of actions: batched outcomes, then delegations and retries."""
        runs = [a for a in actions if isinstance(a, RunOutcome)]
        verdicts = [a for a in actions if isinstance(a, JudgeOutcome)]
        if runs:
            self._write_batch(runs, self.store.finish_running)
        if verdicts:
            self._write_batch(verdicts, self.store.finish_judging)
        delegations = [a for a in actions if isinstance(a, DelegateAction)]
        if len(delegations) > 1:
            try:  # one transaction for all of them; a refused payload: one by one below
                done = self.store.delegate_many(
                    [(d.task_id, d.lease_token, d.children, d.detail) for d in delegations],
                    self.config.worker_id)
            except sa.exc.DataError:
                pass
            else:
                for applied, _ in done:
                    self.stats.delegated += int(applied)
                    self.stats.stale += int(not applied)
                actions = [a for a in actions if not isinstance(a, DelegateAction)]
        for action in actions:
            if isinstance(action, DelegateAction):
                try:
                    applied, _ = self.store.delegate(action.task_id, action.lease_token,
                                                     action.children, self.config.worker_id,
                                                     action.detail)
                except sa.exc.DataError as exc:  # a child payload the database refuses
                    self._write_batch([RunOutcome(
                        action.task_id, action.lease_token, "failed",
                        error=f"delegation could not be stored: {exc.orig}")],
                        self.store.finish_running)
                    continue
                self.stats.delegated += int(applied)
                self.stats.stale += int(not applied)
            elif isinstance(action, RetryAction):
                n = self.store.retry_children(action.task_id, action.lease_token,
                                              action.child_ids, self.config.worker_id,
                                              action.reassign_to, action.detail)
                self.stats.retried_children += n
            elif isinstance(action, Dropped):
                self.stats.dropped += 1
                log.warning("task dropped", extra={"task_id": str(action.task_id),
                                                   "reason": action.reason})

    def _write_batch(self, outcomes: list[Any], write: Any) -> None:
        """Write a batch of outcomes in one statement.

        A row the database refuses (a NUL character in a result, say) fails alone, with
        the reason, instead of blocking the whole batch forever.
        """
        try:
            done = write(outcomes, self.config.worker_id)
        except sa.exc.DataError as exc:
            if len(outcomes) > 1:
                for outcome in outcomes:
                    self._write_batch([outcome], write)
                return
            (bad,) = outcomes
            log.warning("outcome refused by the database", extra={"task_id": str(bad.task_id)})
            reason = f"the outcome could not be stored: {exc.orig}"
            if isinstance(bad, RunOutcome):
                done = self.store.finish_running(
                    [RunOutcome(bad.task_id, bad.lease_token, "failed", error=reason)],
                    self.config.worker_id)
            else:
                verdict = {"passed": False, "score": 0.0, "judge": "rules", "reasons": [reason]}
                done = self.store.finish_judging(
                    [JudgeOutcome(bad.task_id, bad.lease_token, "escalated", verdict,
                                  error=reason)], self.config.worker_id)
        self._count(outcomes, done.applied, done.stale)

    def _count(self, outcomes: list[Any], applied: list[uuid.UUID],
               stale: list[uuid.UUID]) -> None:
        ok = set(applied)
        for o in outcomes:
            if o.task_id in ok:
                self.stats.outcomes[o.to_status] += 1
        self.stats.stale += len(stale)

    def run_once(self) -> int:
        """Claim one batch, execute it in this thread, write the outcomes; return its size.

        Used by tests and by anything that wants to step the runtime by hand.
        """
        self._judging_may_wait.set()  # stepping by hand: always look at both queues
        items = self.claim_batch(self.config.batch_size)
        actions = [self.execute(item) for item in items]
        self.apply(actions)
        return len(items)

    def maintain_once(self) -> bool:
        """One pass of the reaper, the watchdog and the fan-in sweeper; False when skipped.

        Skipped when another worker is running one, or ran one within
        ``maintenance_interval_seconds``.
        """
        done = self.maintenance.run_once()
        if done is None:
            return False
        self.stats.reaped += done.reaped.released
        self.stats.poisoned += done.reaped.poisoned
        self.stats.timed_out += done.timed_out.failed
        self.stats.swept += done.swept.ready
        return True

    # ------------------------------------------------------------------ the loop
    def run(self) -> WorkerStats:
        """Work until stopped, the task cap, the wall clock, or (``once``) an empty queue."""
        asyncio.run(self._main())
        return self.stats

    async def _main(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        self._loop = loop
        # Sync agents' and the judge's model calls run on this loop too (async agents'
        # calls already do): one set of per-server limits, no second loop thread.
        attach = getattr(self.executor.llm_factory, "attach", None)
        if attach is not None:
            attach(loop)
        self._wake_event = asyncio.Event()
        if self._stopping.is_set():
            self._wake_event.set()
        # All threads start now: a thread started on demand in the middle of a burst blocks
        # the loop until it runs (a few ms each, waiting for the GIL).
        self._db_threads = ThreadRunner(DB_THREADS, "db")
        agent_threads = self._agent_threads = ThreadRunner(cfg.threads, "agent")
        # The heartbeat has a thread and a connection of its own: a busy pool never
        # delays it past a lease.
        self._beat_thread = ThreadRunner(1, "heartbeat")
        self._beat_store = Store(create_db_engine(
            self.store.engine.url.render_as_string(hide_password=False), pool_size=1))
        queue: asyncio.Queue[_InFlight] = asyncio.Queue()
        listener = None
        if cfg.listen:
            listener = threading.Thread(target=self._listen_loop, name="listen", daemon=True)
            listener.start()
        background = [loop.create_task(self._heartbeat_loop(), name="heartbeat"),
                      loop.create_task(self._writer_loop(queue), name="writer")]
        if cfg.maintenance:
            background.append(loop.create_task(self._maintenance_loop(), name="maintenance"))
        try:
            await self._claim_loop(queue, agent_threads)
        finally:
            self._stopping.set()
            await self._drain()
            for job in background:
                job.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            agent_threads.shutdown(wait=False, cancel_pending=True)
            detach = getattr(self.executor.llm_factory, "detach", None)
            if detach is not None:
                await detach()
            self._db_threads.shutdown(wait=True)
            self._beat_thread.shutdown(wait=True)
            self._beat_store.dispose()
            self._beat_store = None
            self._loop = None

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking database call off the loop."""
        assert self._db_threads is not None
        return await self._db_threads.run(fn, *args)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking step of an async agent's task (its checks, a read) in a thread."""
        assert self._agent_threads is not None
        return await self._agent_threads.run(fn, *args)

    def _db_error(self, where: str, exc: BaseException) -> None:
        """Count a database error; log it once per streak of failures in one place."""
        self.stats.db_errors += 1
        if where not in self._failing:
            self._failing.add(where)
            error = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:300]
            log.warning(f"database error in the worker's {where}; retrying: "
                        f"{type(exc).__name__}: {error}")

    def _db_ok(self, where: str) -> None:
        if where in self._failing:
            self._failing.discard(where)
            log.info(f"the worker's {where} reaches the database again")

    async def _sleep(self, seconds: float) -> bool:
        """Wait for a wake-up or ``seconds``; True when woken."""
        assert self._wake_event is not None
        try:
            await asyncio.wait_for(self._wake_event.wait(), seconds)
            woken = True
        except TimeoutError:
            woken = False
        self._wake_event.clear()
        return woken

    @property
    def _limit(self) -> int:
        """Most tasks this process holds at once.

        ``max_in_flight``; when every agent served is a sync one, also no more than
        :data:`SYNC_PREFETCH` per sync thread: sync work runs at most ``threads`` at once,
        and the extra tasks wait in memory, not a claim round trip away, when a thread
        frees (the claim of the next batch overlaps the work of this one).
        """
        cfg = self.config
        if self._async_agents:
            return cfg.max_in_flight
        return min(cfg.max_in_flight, cfg.threads * SYNC_PREFETCH)

    def _room(self) -> int:
        """How many more tasks this process may claim now."""
        return self._limit - len(self._inflight)

    async def _claim_loop(self, queue: asyncio.Queue[_InFlight],
                          agent_threads: ThreadRunner) -> None:
        cfg = self.config
        started = time.monotonic()
        threshold = max(1, min(cfg.batch_size, self._limit // 2))
        backoff = 0.1
        polled = False  # the last wait ended at the poll interval, not on a wake-up
        while True:
            if cfg.wall_clock_seconds is not None and \
                    time.monotonic() - started >= cfg.wall_clock_seconds:
                self.stop("wall clock reached")
            if cfg.task_cap is not None and self.stats.claimed >= cfg.task_cap:
                self.stop("task cap reached")
            if self.stopping:
                return
            room = self._room()
            # Claim when enough room is free (or nothing is held): fewer, larger claims.
            # A smaller room is filled at the next poll, so it never stays empty while
            # work waits (a gap left by tasks that ended one by one, say).
            items: list[_InFlight] = []
            if room > 0 and (room >= threshold or not self._inflight or polled):
                try:
                    items = await self._claim(room)
                    self._db_ok("claims")
                    backoff = 0.1
                except DB_ERRORS as exc:
                    self._db_error("claims", exc)
                    await self._sleep(backoff)
                    backoff = min(backoff * 2, DB_RETRY_MAX_SECONDS)
                    continue
            for item in items:
                self._start(item, queue, agent_threads)
            if items and len(items) >= min(room, self._claim_size(room)) and self._room() > 0:
                # The queue had more than we took: claim again at once. The claim goes to
                # a database thread before the tasks just started take the loop, so the
                # next batch is on its way while they start (no sleep(0) between).
                continue
            if cfg.once and not items and not self._inflight:
                self.stop("queue empty")
                return
            polled = not await self._sleep(cfg.poll_interval_seconds)
            if polled:
                self._judging_may_wait.set()  # the polling fallback covers judging too

    def _claim_size(self, room: int) -> int:
        """The most one round of claims asks for: several batches at once with room."""
        if self.config.task_cap is not None:
            return min(room, self.config.batch_size)  # one claim at a time keeps the cap exact
        return min(room, self.config.batch_size * CLAIMS_AT_ONCE)

    async def _claim(self, room: int) -> list[_InFlight]:
        """Claim up to ``room`` tasks: concurrent claims of ``batch_size`` (SKIP LOCKED)."""
        size, batch = self._claim_size(room), self.config.batch_size
        sizes = [min(batch, size - n) for n in range(0, size, batch)]
        if len(sizes) == 1:
            return await self._db(self.claim_batch, sizes[0])
        claimed = await asyncio.gather(*(self._db(self.claim_batch, n) for n in sizes),
                                       return_exceptions=True)
        items = [i for c in claimed if isinstance(c, list) for i in c]
        errors = [c for c in claimed if isinstance(c, BaseException)]
        if errors and not items:
            raise errors[0]
        for error in errors:  # what the other claims got still runs
            self._db_error("claims", error)
        return items

    def _start(self, item: _InFlight, queue: asyncio.Queue[_InFlight],
               agent_threads: ThreadRunner) -> None:
        with self._inflight_lock:
            self._inflight[id(item)] = item
        item.job = asyncio.get_running_loop().create_task(self._work(item, queue, agent_threads))

    async def _work(self, item: _InFlight, queue: asyncio.Queue[_InFlight],
                    agent_threads: ThreadRunner) -> None:
        """Run one task to its action and hand the action to the writer."""
        try:
            if item.kind == "run" and self._async_agents and self.executor.is_async(item.row):
                action: Action = await self.executor.aexecute(item.row, item.lease_lost,
                                                              self._off_loop)
            else:
                action = await agent_threads.run(self.execute, item)
        except Exception as exc:  # the executor catches agent errors; this is a bug
            log.exception("executor crashed", extra={"task_id": str(item.row.id)})
            action = RunOutcome(item.row.id, item.row.lease, "failed",
                                error=f"runtime error: {exc}")
        item.action = action
        queue.put_nowait(item)

    async def _writer_loop(self, queue: asyncio.Queue[_InFlight]) -> None:
        """Write what arrives within a few milliseconds together; retry on database errors."""
        while True:
            batch = [await queue.get()]
            await asyncio.sleep(WRITE_WINDOW_SECONDS)
            while not queue.empty():
                batch.append(queue.get_nowait())
            backoff = 0.1
            while True:
                try:
                    await self._db(self.apply, [i.action for i in batch if i.action is not None])
                    self._db_ok("writer")
                    break
                except DB_ERRORS as exc:
                    self._db_error("writer", exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, DB_RETRY_MAX_SECONDS)
            with self._inflight_lock:
                for item in batch:
                    self._inflight.pop(id(item), None)
            self._wake()

    async def _heartbeat_loop(self) -> None:
        """Extend the leases held, every third of the lease, until the worker is done."""
        interval = self.config.lease_seconds / 3
        while True:
            await asyncio.sleep(interval)
            try:
                assert self._beat_thread is not None
                await self._beat_thread.run(self.heartbeat_once)
            except Exception as exc:  # never let the heartbeat die
                self._db_error("heartbeat", exc)

    async def _maintenance_loop(self) -> None:
        interval = self.config.maintenance_interval_seconds
        while not self.stopping:
            await asyncio.sleep(interval)
            try:
                await self._db(self.maintain_once)
                self._db_ok("maintenance")
            except DB_ERRORS as exc:
                self._db_error("maintenance", exc)

    async def _drain(self) -> None:
        """Let in-flight work finish and be written within the grace, then release the rest."""
        deadline = time.monotonic() + self.config.stop_grace_seconds
        while self._inflight and time.monotonic() < deadline:
            await self._sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        with self._inflight_lock:
            leftover = list(self._inflight.values())
            self._inflight.clear()
        for item in leftover:
            item.lease_lost.set()
            if item.job is not None:
                item.job.cancel()
        tokens = [i.row.lease_token for i in leftover if i.row.lease_token is not None]
        for attempt in range(5):
            if not tokens:
                break
            try:
                self.stats.released += await self._db(self.store.release, tokens,
                                                      self.config.worker_id)
                break
            except DB_ERRORS as exc:
                self._db_error("release", exc)
                await asyncio.sleep(0.2 * (attempt + 1))

    # ------------------------------------------------------------------ threads
    def heartbeat_once(self) -> int:
        """Extend every lease held; flag tasks whose lease was lost. Returns how many held."""
        with self._inflight_lock:
            items = list(self._inflight.values())
        if not items:
            return 0
        try:
            held = (self._beat_store or self.store).heartbeat([i.row.lease for i in items],
                                                              self.config.lease_seconds)
        except DB_ERRORS as exc:
            self._db_error("heartbeat", exc)
            return 0
        self._db_ok("heartbeat")
        with self._inflight_lock:
            still_running = {id(i) for i in self._inflight.values()}
        for item in items:
            # A task that finished while the heartbeat ran is not lost, just done.
            if item.row.lease_token not in held and id(item) in still_running \
                    and not item.lease_lost.is_set():
                item.lease_lost.set()
                log.warning("lease lost", extra={"task_id": str(item.row.id)})
        return len(held)


    def _listen_loop(self) -> None:
        wanted = set(self.config.run_agents) | ({JUDGE} if self.config.judges else set())
        url = libpq_url(self.store.engine.url.render_as_string(hide_password=False))
        while not self._stopping.is_set():
            try:
                with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    self._wake()  # anything sent while we were away is in the table
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=1.0):
                            if note.payload in wanted:
                                if note.payload == JUDGE:
                                    self._judging_may_wait.set()
                                self._wake()
            except psycopg.Error as exc:
                log.info("listener reconnecting", extra={"error": str(exc)})
                self._stopping.wait(1.0)
