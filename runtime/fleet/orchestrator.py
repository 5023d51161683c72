"""``orgchart fire``: one fire of the decider, then a pool of disposable workers (seed 000).

A fire, in order:

1. takes a PostgreSQL advisory lock on a dedicated connection held for the whole fire,
   so one fire runs at a time across machines; a fire that finds it taken does nothing;
2. refuses to run past ``daily_cap`` fires in the last 24 hours (checked after the lock,
   so a catch-up double fire cannot launch two fan-outs);
3. writes its ``fires`` row and runs hygiene: reaper, watchdog and fan-in sweeper, so
   work stranded by dead workers is claimable again before anyone is launched;
4. decides: a :class:`~runtime.fleet.decider.Snapshot` of the queue, the escalations and the
   status counts goes to the configured decider, which returns a plan;
5. fans out ``orgchart worker --agents MODE --task-cap N --wall-clock S --once --json``
   processes (never more than ``max_workers`` at once). Work flows between modes (a
   parent delegates, its children finish, the judge passes them, the parent aggregates),
   so whenever a worker exits, or every ``replan_interval_seconds`` while a slot is free,
   the queue is read and planned again, until it is empty or the fire's wall clock is
   spent. A mode whose worker claimed nothing is not relaunched until another worker
   makes progress (a task in backoff must not spawn a process per poll);
6. barrier: waits for every worker; one that outlives its wall clock (plus
   ``term_slack_seconds`` for start-up) gets SIGTERM, then SIGKILL after
   ``kill_grace_seconds``;
7. rolls up one note (stored on the fires row and printed): tasks drained per mode, from
   the workers' JSON stats cross-checked against the ``task_events`` their ids wrote;
   failures and escalations grouped by cause; anomalies; and what needs a person.

Failure modes: a database error mid-fire stops the launches, terminates the running
workers and still tries to finish the fires row; a lost lock connection is not noticed
until the fire ends (the fire keeps its caps either way). Workers inherit the
environment, so they reach the same database.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import IO, Any

from runtime.config import OrchestratorSettings, Settings
from runtime.engine.maintenance import Reaper, Sweeper, Watchdog
from runtime.errors import BadInput
from runtime.fleet.decider import JUDGE_MODE, Decider, Limits, Plan, Snapshot, load_decider
from runtime.fleet.rollup import Hygiene, WorkerRun, build_rollup
from runtime.store.store import Store

log = logging.getLogger(__name__)

#: The advisory lock key every fire takes (a fixed 64-bit value derived from a name).
FIRE_LOCK_KEY = int.from_bytes(hashlib.sha256(b"orgchart:fire").digest()[:8], "big",
                               signed=True)
DAY = dt.timedelta(hours=24)
#: Start-up time allowed on top of a worker's wall clock before it gets SIGTERM.
TERM_SLACK_SECONDS = 5.0
#: Time between SIGTERM and SIGKILL: longer than the worker's own stop grace (10 s), so
#: a terminated worker can finish or hand back its tasks. A longer ``[worker]
#: stop_grace_seconds`` gets this much more than itself (:meth:`FireConfig.from_settings`).
KILL_GRACE_SECONDS = 15.0
KILL_GRACE_MARGIN_SECONDS = 5.0
#: How often the barrier looks at its workers.
BARRIER_POLL_SECONDS = 0.1
REPLAN_INTERVAL_SECONDS = 1.0
#: A worker is not launched with less wall clock than this left in the fire.
MIN_WORKER_SECONDS = 1.0
#: Event writers whose failures the rollup counts besides the fire's workers.
HYGIENE_WRITERS = ("reaper", "watchdog")
STDERR_TAIL_CHARS = 2000


@dataclass(frozen=True)
class FireConfig:
    """How one fire runs: ``[orchestrator]`` with the command's flags, and the fire's own fields.

    The section holds the caps and the decider, their defaults and validation, once
    (:mod:`runtime.config`); the fields here are no settings (the modules of
    ``--agents-module``, the barrier's timings, the Python and environment of the
    workers, the lock key). Build one with :meth:`from_settings`.
    """

    orchestrator: OrchestratorSettings = field(default_factory=OrchestratorSettings)
    agents_modules: tuple[str, ...] = ()
    term_slack_seconds: float = TERM_SLACK_SECONDS
    kill_grace_seconds: float = KILL_GRACE_SECONDS
    barrier_poll_seconds: float = BARRIER_POLL_SECONDS
    replan_interval_seconds: float = REPLAN_INTERVAL_SECONDS
    min_worker_seconds: float = MIN_WORKER_SECONDS
    python: str = sys.executable
    env: Mapping[str, str] | None = field(default=None, compare=False)
    lock_key: int = FIRE_LOCK_KEY

    def __post_init__(self) -> None:
        for name, value in (("barrier_poll_seconds", self.barrier_poll_seconds),
                            ("replan_interval_seconds", self.replan_interval_seconds)):
            if value <= 0:
                raise ValueError(f"{name} must be positive (got {value})")
        for name, value in (("term_slack_seconds", self.term_slack_seconds),
                            ("kill_grace_seconds", self.kill_grace_seconds),
                            ("min_worker_seconds", self.min_worker_seconds)):
            if value < 0:
                raise ValueError(f"{name} cannot be negative (got {value})")

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> FireConfig:
        """``[orchestrator]`` with the non-None ``overrides`` on top.

        An override naming an ``[orchestrator]`` key (``max_workers``, ``task_cap``, ...)
        is validated by the section; the others are this class's own fields.

        Raises:
            BadInput: an override is out of range (the message names it).

        """
        given = {k: v for k, v in overrides.items() if v is not None}
        given.setdefault("kill_grace_seconds", max(
            KILL_GRACE_SECONDS, settings.worker.stop_grace_seconds + KILL_GRACE_MARGIN_SECONDS))
        given["agents_modules"] = tuple(given.get("agents_modules") or ())
        try:
            orchestrator = settings.orchestrator.override_from(given)  # takes its keys out
            return cls(orchestrator=orchestrator, **given)
        except ValueError as exc:
            raise BadInput(str(exc)) from None

    @property
    def limits(self) -> Limits:
        """The caps handed to the decider."""
        o = self.orchestrator
        return Limits(o.max_workers, o.task_cap, o.wall_clock_seconds)


@dataclass
class FireResult:
    """What ``run_once`` did: ``ran``, ``locked``, ``capped`` or ``dry_run``."""

    status: str
    message: str
    fire_id: int | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    rollup: str = ""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        return {"status": self.status, "message": self.message, "fire_id": self.fire_id,
                "plan": self.plan, "stats": self.stats, "rollup": self.rollup}


@dataclass
class _Proc:
    run: WorkerRun
    popen: subprocess.Popen[bytes]
    out: IO[bytes]
    err: IO[bytes]
    started: float
    term_at: float
    kill_at: float | None = None
    hurried: bool = False


class Orchestrator:
    """One fire: lock, cap, hygiene, decide, fan out, barrier, rollup."""

    def __init__(self, store: Store, settings: Settings, config: FireConfig) -> None:
        self.store = store
        self.settings = settings
        self.config = config
        self.decider: Decider = load_decider(config.orchestrator.decider)
        self._stop = threading.Event()
        self._hurry = threading.Event()
        self._stop_reason = ""
        self._known: set[str] | None = None
        self._host = socket.gethostname()

    def stop(self, reason: str = "stopped", now: bool = False) -> None:
        """Stop launching, terminate the running workers, and finish the fire's note.

        ``now`` (a second signal) sends the workers a second SIGTERM: they hand back what
        they hold at once instead of giving it their stop grace.
        """
        self._stop_reason = self._stop_reason or reason
        if now:
            self._hurry.set()
        self._stop.set()

    # ------------------------------------------------------------------ entry points
    def run_once(self, fire_id: int | None = None) -> FireResult:
        """One fire; a fire that cannot run (lock taken, daily cap) does nothing and says why.

        ``fire_id``: the ``fires`` row a schedule's slot wrote with the slot
        (``runtime/schedules/``); this fire runs as that row, and a fire that cannot run
        finishes it with the reason.
        """
        cfg = self.config
        with self.store.fires.lock(cfg.lock_key) as locked:
            if not locked:
                return self._refused(fire_id, FireResult(
                    "locked", "another fire is running; nothing done", fire_id))
            recent = self.fires_in_a_day()
            if recent - (fire_id is not None) >= cfg.orchestrator.daily_cap:
                return self._refused(fire_id, FireResult(
                    "capped", f"daily cap reached: {recent} fire(s) in the last 24 h, "
                              f"daily_cap = {cfg.orchestrator.daily_cap}; nothing done", fire_id))
            return self._fire(fire_id)

    def fires_in_a_day(self) -> int:
        """Fires started in the last 24 hours (what ``daily_cap`` caps)."""
        return self.store.fires.count_since(dt.datetime.now(dt.UTC) - DAY)

    def _refused(self, fire_id: int | None, result: FireResult) -> FireResult:
        """Finish a scheduled fire's row with the reason it did not run."""
        if fire_id is not None:
            self.store.fires.finished(fire_id, {"status": result.status}, {}, result.message)
        return result

    def plan_only(self) -> FireResult:
        """The plan a fire would make now (no lock, no hygiene, no workers, no fires row)."""
        plan, unknown = self.decide()
        notes = [f"{n} task(s) queued for {mode!r}, which no loaded module registers"
                 for mode, n in unknown.items()]
        recent = self.fires_in_a_day()
        if recent >= self.config.orchestrator.daily_cap:
            notes.append(f"a fire now would be refused: {recent} fire(s) in the last 24 h, "
                         f"daily_cap = {self.config.orchestrator.daily_cap}")
        text = "\n".join([plan.describe(), *plan.notes, *notes])
        return FireResult("dry_run", "dry run: nothing started, nothing written",
                          plan=plan.as_dict(), rollup=text)

    # ------------------------------------------------------------------ the steps
    def hygiene(self) -> Hygiene:
        """Release expired leases, time out overdue tasks, sweep missed fan-ins."""
        reaped = Reaper(self.store, self.settings.retry).run_once()
        timed_out = Watchdog(self.store).run_once()
        swept = Sweeper(self.store).run_once()
        return Hygiene(reaped.released, reaped.poisoned, timed_out.failed, swept.ready)

    def snapshot(self) -> tuple[Snapshot, dict[str, int]]:
        """Read the queue, escalations and status counts; split off unknown agents."""
        known = self.known_modes()
        queue = self.store.reads.queue()
        unknown = Counter({str(r["to_agent"]): int(r["n"]) for r in queue
                           if r["to_agent"] not in known and int(r["n"]) > 0})
        snap = Snapshot.from_rows([r for r in queue if r["to_agent"] in known],
                                  self.store.reads.escalations(),
                                  self.store.database.query("task_count_by_status"),
                                  self.config.limits)
        return snap, dict(unknown)

    def decide(self) -> tuple[Plan, dict[str, int]]:
        """Ask the decider for a plan; clamp it to the fire's caps and the known modes."""
        snap, unknown = self.snapshot()
        plan = self.decider.plan(snap)
        if not isinstance(plan, Plan):
            raise TypeError(f"decider {self.config.orchestrator.decider!r} returned "
                            f"{type(plan).__name__}, not a Plan")
        cfg = self.config.orchestrator
        kept = []
        for a in plan.assignments:
            if a.mode not in self.known_modes():
                unknown.setdefault(a.mode, 0)
                continue
            kept.append(replace(a, workers=min(a.workers, cfg.max_workers),
                                task_cap=min(a.task_cap, cfg.task_cap),
                                wall_clock_seconds=min(a.wall_clock_seconds,
                                                       cfg.wall_clock_seconds)))
        return Plan(tuple(kept), plan.notes), unknown

    def known_modes(self) -> set[str]:
        """Registered agents (built-in and ``--agents-module``) plus the judge stage."""
        if self._known is None:
            from runtime.wiring import load_registry

            registry = load_registry(self.settings, self.config.agents_modules)
            self._known = {*registry.names(), JUDGE_MODE}
        return self._known

    # ------------------------------------------------------------------ one fire
    def _fire(self, fire_id: int | None = None) -> FireResult:
        started = time.monotonic()
        watermark = self.store.fires.event_watermark()
        if fire_id is None:
            fire_id = self.store.fires.started({"status": "running"})
        runs: list[WorkerRun] = []
        record: dict[str, Any] = {"first": None, "plans": 0, "launched": []}
        notes: list[str] = []
        hygiene = Hygiene()
        error: BaseException | None = None
        try:
            hygiene = self.hygiene()
            self._fan_out(runs, record, notes)
        except BaseException as exc:  # the fires row must still be finished
            error = exc
            notes.append(f"fire aborted: {type(exc).__name__}: {exc}")
            log.exception("fire aborted", extra={"fire_id": fire_id})
        if self._stop_reason:
            notes.append(f"fire stopped early: {self._stop_reason}")
        try:
            result = self._finish(fire_id, started, watermark, runs, record, notes, hygiene)
        except Exception:
            if error is None:
                raise
            log.exception("could not write the rollup of an aborted fire")
            result = FireResult("ran", "fire aborted", fire_id)
        if error is not None:
            raise error
        return result

    def _finish(self, fire_id: int, started: float, watermark: int, runs: list[WorkerRun],
                record: dict[str, Any], notes: list[str], hygiene: Hygiene) -> FireResult:
        prefixes = [run.prefix for run in runs]
        queue = self.store.reads.queue()
        left: Counter[str] = Counter()
        for row in queue:
            left[str(row["to_agent"])] += int(row["n"])
        rollup = build_rollup(
            fire_id=fire_id, runs=runs, hygiene=hygiene,
            event_rows=self.store.fires.event_counts_by_worker(watermark, prefixes),
            failures=self.store.fires.failures_since(watermark, [*prefixes, *HYGIENE_WRITERS]),
            escalations=self.store.reads.escalations(), left_queued=+left,
            plans=record["plans"], seconds=time.monotonic() - started, notes=notes)
        plan = {"first": record["first"], "plans": record["plans"],
                "launched": record["launched"]}
        self.store.fires.finished(fire_id, plan, rollup.stats, rollup.text)
        return FireResult("ran", f"fire {fire_id} finished", fire_id, plan, rollup.stats,
                          rollup.text)

    # ------------------------------------------------------------------ the pool
    def _fan_out(self, runs: list[WorkerRun], record: dict[str, Any], notes: list[str]) -> None:
        """Launch, re-plan and reap workers until the queue is empty or time is up."""
        cfg = self.config
        deadline = time.monotonic() + cfg.orchestrator.wall_clock_seconds
        procs: list[_Proc] = []
        exhausted: set[str] = set()
        reported_unknown: set[str] = set()
        replan, last_plan = True, float("-inf")
        try:
            while True:
                now = time.monotonic()
                for proc in self._collect_exited(procs):
                    claimed = int((proc.run.stats or {}).get("claimed") or 0)
                    if claimed > 0:
                        exhausted.clear()  # progress may have made work for any mode
                    else:
                        exhausted.add(proc.run.mode)
                    replan = True
                self._enforce_clocks(procs, now)
                closing = self._stop.is_set() or now >= deadline - cfg.min_worker_seconds
                launched = 0
                free = cfg.orchestrator.max_workers - len(procs)
                if not closing and free > 0 and (
                        replan or not procs or now - last_plan >= cfg.replan_interval_seconds):
                    plan, unknown = self.decide()
                    for mode in set(unknown) - reported_unknown:
                        reported_unknown.add(mode)
                        notes.append(f"{unknown[mode]} task(s) queued for {mode!r}, which no "
                                     "loaded module registers: no worker can take them")
                    record["plans"] += 1
                    if record["first"] is None:
                        record["first"] = plan.as_dict()
                    replan, last_plan = False, now
                    for proc in self._launch_from(plan, procs, free, exhausted, deadline - now):
                        procs.append(proc)
                        runs.append(proc.run)
                        record["launched"].append(
                            {"mode": proc.run.mode, "pid": proc.run.pid,
                             "task_cap": proc.run.task_cap,
                             "wall_clock_seconds": proc.run.wall_clock_seconds})
                        launched += 1
                if not procs and (closing or launched == 0):
                    return
                if self._stop.is_set():  # a set event's wait returns at once: pace here
                    time.sleep(cfg.barrier_poll_seconds)
                else:
                    self._stop.wait(cfg.barrier_poll_seconds)
        except BaseException:
            self._stop.set()  # terminate the workers instead of waiting them out
            raise
        finally:
            self._barrier(procs)

    def _launch_from(self, plan: Plan, procs: list[_Proc], free: int, exhausted: set[str],
                     remaining: float) -> Iterator[_Proc]:
        """Start the plan's workers that are not running yet, in plan order, within ``free``."""
        running = Counter(p.run.mode for p in procs)
        for a in plan.assignments:
            if a.mode in exhausted:
                continue
            while running[a.mode] < a.workers and free > 0:
                yield self._launch(a.mode, a.task_cap, round(min(a.wall_clock_seconds,
                                                                 remaining), 3))
                running[a.mode] += 1
                free -= 1

    def worker_command(self, mode: str, task_cap: int, wall_clock_seconds: float) -> list[str]:
        """The command line of one disposable worker."""
        cmd = [self.config.python, "-m", "runtime.cli", "worker", "--agents", mode,
               "--task-cap", str(task_cap), "--wall-clock", repr(float(wall_clock_seconds)),
               "--once", "--json"]
        for module in self.config.agents_modules:
            cmd += ["--agents-module", module]
        return cmd

    def _launch(self, mode: str, task_cap: int, wall_clock_seconds: float) -> _Proc:
        cmd = self.worker_command(mode, task_cap, wall_clock_seconds)
        env = dict(self.config.env) if self.config.env is not None else dict(os.environ)
        # Files, not pipes: a chatty worker can never block on a full pipe. Closed in
        # _collect once the worker has exited.
        out = tempfile.TemporaryFile()  # noqa: SIM115
        err = tempfile.TemporaryFile()  # noqa: SIM115
        popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        now = time.monotonic()
        run = WorkerRun(mode, popen.pid, f"{self._host}:{popen.pid}:", task_cap,
                        wall_clock_seconds)
        log.info("worker launched", extra={"mode": mode, "pid": popen.pid,
                                           "task_cap": task_cap, "wall_clock": wall_clock_seconds})
        return _Proc(run, popen, out, err, now,
                     term_at=now + wall_clock_seconds + self.config.term_slack_seconds)

    def _enforce_clocks(self, procs: list[_Proc], now: float) -> None:
        """SIGTERM workers past their wall clock (or all, when stopping); SIGKILL after grace."""
        for proc in procs:
            if proc.popen.poll() is not None:
                continue
            if proc.kill_at is None and (now >= proc.term_at or self._stop.is_set()):
                proc.popen.send_signal(signal.SIGTERM)
                proc.run.signal = "SIGTERM"
                proc.run.stopped_by_fire = now < proc.term_at
                proc.kill_at = now + self.config.kill_grace_seconds
                log.warning("worker terminated: %s", "the fire is stopping"
                            if proc.run.stopped_by_fire else "past its wall clock",
                            extra={"pid": proc.run.pid})
            elif proc.kill_at is not None and self._hurry.is_set() and not proc.hurried:
                proc.popen.send_signal(signal.SIGTERM)  # the second: hand back, exit now
                proc.hurried = True
            elif proc.kill_at is not None and now >= proc.kill_at and \
                    proc.run.signal != "SIGKILL":
                proc.popen.kill()
                proc.run.signal = "SIGKILL"
                log.warning("worker ignored SIGTERM: SIGKILL", extra={"pid": proc.run.pid})

    def _barrier(self, procs: list[_Proc]) -> None:
        """Wait for every worker still running, enforcing their clocks."""
        while procs:
            now = time.monotonic()
            self._collect_exited(procs)
            self._enforce_clocks(procs, now)
            if procs:
                time.sleep(self.config.barrier_poll_seconds)

    def _collect_exited(self, procs: list[_Proc]) -> list[_Proc]:
        """Take the workers that exited out of ``procs``, collected; return them."""
        exited = [p for p in procs if p.popen.poll() is not None]
        for proc in exited:
            procs.remove(proc)
            self._collect(proc)
        return exited

    def _collect(self, proc: _Proc) -> None:
        """Read an exited worker's JSON report and the tail of its stderr."""
        run = proc.run
        run.exit_code = proc.popen.returncode
        run.seconds = time.monotonic() - proc.started
        try:
            proc.out.seek(0)
            text = proc.out.read().decode("utf-8", "replace")
            proc.err.seek(-min(STDERR_TAIL_CHARS, proc.err.seek(0, 2)), 2)
            run.stderr_tail = proc.err.read().decode("utf-8", "replace")
        finally:
            proc.out.close()
            proc.err.close()
        try:
            stats = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            stats = None
        run.stats = stats if isinstance(stats, dict) else None
        if run.signal == "SIGTERM" and run.exit_code == 0 and run.stats is not None:
            run.signal = "SIGTERM (exited cleanly)"
