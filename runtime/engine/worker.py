"""``orgchart worker``: claims tasks, runs agents and the judge, writes the outcomes.

The main loop claims batches (``FOR UPDATE SKIP LOCKED``) up to its free capacity, hands
each task to a thread pool, and applies finished actions in batches: one statement for
all run outcomes, one for all verdicts, one per delegation. It wakes on LISTEN/NOTIFY
(``orgchart_tasks``; the payload is the agent name, ``judge`` for the judge stage) and
polls every ``poll_interval_seconds`` as a fallback.

Beside it run three threads: the heartbeat (every third of ``lease_seconds`` it extends
every lease it holds and flags the tasks whose lease was taken away), the listener, and
maintenance (reaper, watchdog and fan-in sweeper ``run_once()`` every
``maintenance_interval_seconds``; any number of workers may do this at once).

Options (``WorkerConfig``): agents, concurrency, batch size, lease, task cap, wall clock,
``once`` (exit when the queue is empty). It stops on ``stop()`` (SIGTERM/SIGINT in the
CLI): no more claims, in-flight work gets ``stop_grace_seconds`` to finish, whatever is
left is released back to the queue.

Failure modes: a database error in the loop is logged and retried with backoff (the
engine's pre-ping reconnects after a server restart); outcomes that could not be written
are kept and written again; if the lease expired meanwhile, the write matches nothing
and the task runs again elsewhere (at-least-once execution, exactly-once outcome).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy as sa

from runtime.engine.executor import Action, DelegateAction, Dropped, Executor, RetryAction
from runtime.engine.maintenance import Reaper, ReaperConfig, Sweeper, Watchdog
from runtime.store.db import libpq_url
from runtime.store.rows import JudgeOutcome, RunOutcome
from runtime.store.store import Store

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "orgchart_tasks"
JUDGE = "judge"
DB_RETRY_MAX_SECONDS = 5.0
STOP_GRACE_SECONDS = 10.0


def new_worker_id() -> str:
    """``host:pid:random`` so leases name who holds them."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerConfig:
    """How one worker runs; validated on creation."""

    agents: tuple[str, ...]
    worker_id: str = field(default_factory=new_worker_id)
    concurrency: int = 4
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
        if self.concurrency < 1 or self.batch_size < 1:
            raise ValueError("concurrency and batch_size must be at least 1")
        if self.lease_seconds <= 0 or self.poll_interval_seconds <= 0:
            raise ValueError("lease_seconds and poll_interval_seconds must be positive")
        if self.task_cap is not None and self.task_cap < 1:
            raise ValueError("task_cap must be at least 1")
        if self.wall_clock_seconds is not None and self.wall_clock_seconds <= 0:
            raise ValueError("wall_clock_seconds must be positive")

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


@dataclass
class _InFlight:
    row: dict[str, Any]
    kind: str  # "run" or "judge"
    lease_lost: threading.Event


class Worker:
    """Claims, executes and completes tasks for a set of agents."""

    def __init__(self, store: Store, executor: Executor, config: WorkerConfig) -> None:
        self.store = store
        self.executor = executor
        self.config = config
        executor.inline_judge = config.judges
        self.stats = WorkerStats()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._judging_may_wait = threading.Event()
        self._judging_may_wait.set()
        self._inflight: dict[Future[Action], _InFlight] = {}
        self._inflight_lock = threading.Lock()
        self._unwritten: list[Action] = []
        self._judge_first = False
        self.reaper = Reaper(store, ReaperConfig(max_delivery=config.max_delivery))
        self.watchdog = Watchdog(store)
        self.sweeper = Sweeper(store)

    # ------------------------------------------------------------------ control
    def stop(self, reason: str = "stopped") -> None:
        """Stop claiming; in-flight work finishes (or is released) and ``run`` returns."""
        if not self._stopping.is_set():
            self.stats.stop_reason = self.stats.stop_reason or reason
            self._stopping.set()
            self._wake.set()

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

    def maintain_once(self) -> None:
        """One pass of the reaper, the watchdog and the fan-in sweeper."""
        reaped = self.reaper.run_once()
        timed_out = self.watchdog.run_once()
        swept = self.sweeper.run_once()
        self.stats.reaped += reaped.released
        self.stats.poisoned += reaped.poisoned
        self.stats.timed_out += timed_out.failed
        self.stats.swept += swept.ready

    # ------------------------------------------------------------------ the loop
    def run(self) -> WorkerStats:
        """Work until stopped, the task cap, the wall clock, or (``once``) an empty queue."""
        cfg = self.config
        started = time.monotonic()
        threads = [threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)]
        if cfg.listen:
            threads.append(threading.Thread(target=self._listen_loop, name="listen", daemon=True))
        if cfg.maintenance:
            threads.append(threading.Thread(target=self._maintenance_loop, name="maintenance",
                                            daemon=True))
        for t in threads:
            t.start()
        pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="agent")
        backoff = 0.1
        try:
            while True:
                if cfg.wall_clock_seconds is not None and \
                        time.monotonic() - started >= cfg.wall_clock_seconds:
                    self.stop("wall clock reached")
                if cfg.task_cap is not None and self.stats.claimed >= cfg.task_cap:
                    self.stop("task cap reached")
                if self.stopping:
                    break
                try:
                    self._flush()
                    free = cfg.concurrency - len(self._inflight)
                    # Claim when half the slots are free (or none is busy): fewer, larger
                    # claims; one statement per claim is where throughput comes from.
                    worth_it = free >= max(1, cfg.concurrency // 2) or not self._inflight
                    items = self.claim_batch(free) if free > 0 and worth_it else []
                    backoff = 0.1
                except sa.exc.DBAPIError as exc:
                    self.stats.db_errors += 1
                    log.warning("database error in the worker loop; retrying",
                                extra={"error": str(exc.orig), "backoff": backoff})
                    self._wake.wait(backoff)
                    backoff = min(backoff * 2, DB_RETRY_MAX_SECONDS)
                    continue
                for item in items:
                    self._submit(pool, item)
                if self._collect():
                    continue
                if items and len(items) >= min(free, cfg.batch_size):
                    continue  # the queue had more than we took: go again
                with self._inflight_lock:
                    idle = not self._inflight
                if cfg.once and idle and not items and not self._unwritten:
                    self.stop("queue empty")
                    break
                if not self._wake.wait(cfg.poll_interval_seconds):
                    self._judging_may_wait.set()  # the polling fallback covers judging too
                self._wake.clear()
        finally:
            self._drain(pool)
        return self.stats

    def _submit(self, pool: ThreadPoolExecutor, item: _InFlight) -> None:
        future = pool.submit(self.execute, item)
        with self._inflight_lock:
            self._inflight[future] = item
        future.add_done_callback(lambda _f: self._wake.set())

    def _collect(self) -> bool:
        with self._inflight_lock:
            done = [f for f in self._inflight if f.done()]
            items = [self._inflight.pop(f) for f in done]
        if not done:
            return False
        for future, item in zip(done, items, strict=True):
            try:
                self._unwritten.append(future.result())
            except Exception as exc:  # the executor catches agent errors; this is a bug
                log.exception("executor crashed", extra={"task_id": str(item.row["id"])})
                self._unwritten.append(RunOutcome(item.row["id"], item.row["lease_token"],
                                                  "failed", error=f"runtime error: {exc}"))
        try:
            self._flush()
        except sa.exc.DBAPIError as exc:  # kept in _unwritten; the loop retries with backoff
            self.stats.db_errors += 1
            log.warning("could not write outcomes; will retry", extra={"error": str(exc.orig)})
        return True

    def _flush(self) -> None:
        if not self._unwritten:
            return
        actions, self._unwritten = self._unwritten, []
        try:
            self.apply(actions)
        except sa.exc.DBAPIError:
            self._unwritten = actions + self._unwritten
            raise

    def _drain(self, pool: ThreadPoolExecutor) -> None:
        """Let in-flight work finish within the grace period, then release the rest."""
        deadline = time.monotonic() + self.config.stop_grace_seconds
        while self._inflight and time.monotonic() < deadline:
            self._wake.wait(0.05)
            self._wake.clear()
            try:
                self._collect()
            except sa.exc.DBAPIError:
                time.sleep(0.2)
        with self._inflight_lock:
            leftover = list(self._inflight.values())
            self._inflight.clear()
        for attempt in range(5):
            try:
                self._flush()
                if leftover:
                    self.stats.released += self.store.release(
                        [i.row["lease_token"] for i in leftover], self.config.worker_id)
                    for item in leftover:
                        item.lease_lost.set()
                    leftover = []
                break
            except sa.exc.DBAPIError:
                time.sleep(0.2 * (attempt + 1))
        pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ threads
    def _heartbeat_loop(self) -> None:
        interval = self.config.lease_seconds / 3
        while not self._stopping.wait(interval):
            self.heartbeat_once()
        # keep leases alive while draining
        while True:
            with self._inflight_lock:
                if not self._inflight:
                    return
            self.heartbeat_once()
            time.sleep(interval)

    def heartbeat_once(self) -> int:
        """Extend every lease held; flag tasks whose lease was lost. Returns how many held."""
        with self._inflight_lock:
            items = list(self._inflight.values())
        if not items:
            return 0
        try:
            held = self.store.heartbeat([i.row["lease_token"] for i in items],
                                        self.config.lease_seconds)
        except sa.exc.DBAPIError as exc:
            log.warning("heartbeat failed", extra={"error": str(exc.orig)})
            return 0
        with self._inflight_lock:
            still_running = {id(i) for i in self._inflight.values()}
        for item in items:
            # A task that finished while the heartbeat ran is not lost, just done.
            if item.row["lease_token"] not in held and id(item) in still_running \
                    and not item.lease_lost.is_set():
                item.lease_lost.set()
                log.warning("lease lost", extra={"task_id": str(item.row["id"])})
        return len(held)

    def _maintenance_loop(self) -> None:
        while not self._stopping.wait(self.config.maintenance_interval_seconds):
            try:
                self.maintain_once()
            except sa.exc.DBAPIError as exc:
                log.warning("maintenance failed", extra={"error": str(exc.orig)})

    def _listen_loop(self) -> None:
        wanted = set(self.config.run_agents) | ({JUDGE} if self.config.judges else set())
        url = libpq_url(self.store.engine.url.render_as_string(hide_password=False))
        while not self._stopping.is_set():
            try:
                with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    self._wake.set()  # anything sent while we were away is in the table
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=1.0):
                            if note.payload in wanted:
                                if note.payload == JUDGE:
                                    self._judging_may_wait.set()
                                self._wake.set()
            except psycopg.Error as exc:
                log.info("listener reconnecting", extra={"error": str(exc)})
                self._stopping.wait(1.0)
