"""The tick: every worker, ``serve`` and ``fire`` process fires the schedules' due slots.

:meth:`Ticker.run_once` reads the schedules with a slot due (``ix_schedules_due``), then
handles each in its own transaction under the schedule's row lock
(:meth:`runtime.store.schedules.Schedules.tick`):

1. the due slots are split by the catch-up window (:func:`~runtime.schedules.slots.plan_slots`):
   older ones are recorded as one ``missed`` row counting them, the others are fired
   once each, oldest first;
2. each slot to fire follows the overlap policy: ``skip`` records it ``skipped`` while
   a root (or fire) the schedule started is open; ``cancel_previous`` cancels the open
   ones through the existing cancel (several slots due in one tick: only the newest
   fires, the older are recorded as skipped, replaced); ``allow`` just fires;
3. a fired slot's ``schedule_runs`` row goes in with the root it inserts (or the
   ``fires`` row), and ``next_at`` moves past the last slot handled, all in the one
   transaction: a process killed mid-tick rolls it all back, and another fires them.

A fire schedule's fire runs after the commit, through the ``start_fire`` callback the
process gives (``Orchestrator.run_once(fire_id=...)`` in a thread); a ticker without one
(a disposable ``worker --once``) leaves fire schedules to the others.

:meth:`Ticker.start` runs the tick every ``interval_seconds`` in a daemon thread.
Failure modes: a database error ends that tick (logged; the next tick tries again);
a schedule whose root cannot be inserted is logged and retried at each tick.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.config import OrchestratorSettings, Settings
from runtime.core.dberrors import one_line
from runtime.schedules.slots import MAX_COUNTED_SLOTS, plan_slots
from runtime.schedules.spec import cadence_of, task_of
from runtime.store.rows import NotFound
from runtime.store.schedules import SlotWriter
from runtime.store.store import Store

log = logging.getLogger(__name__)

#: How often a process ticks (slot-to-root latency is at most about this, plus a commit).
TICK_INTERVAL_SECONDS = 0.5
#: Most slots one schedule fires in one tick (a long catch-up continues at the next).
MAX_SLOTS_PER_TICK = 1000
#: Most due schedules one tick reads (the rest are the next tick's).
MAX_SCHEDULES_PER_TICK = 100
#: Added to ``[orchestrator] wall_clock_seconds``: a scheduled fire still unfinished
#: after both died with its process (a fire lasts its wall clock plus start-up slack and
#: kill grace), and the overlap policy no longer waits for it.
FIRE_MARGIN_SECONDS = 300.0

#: Runs the fire a fire schedule's slot started (its ``fires`` row is committed).
FireStarter = Callable[[int], None]


@dataclass(frozen=True)
class TickerConfig:
    """How a process ticks: ``[orchestrator]`` (a fire's wall clock) and the tick's own fields.

    The section holds every user-facing value once (:mod:`runtime.config`); the fields
    here are what a process adds (its name in the runs it records) and the tick's pace,
    which no user sets (tests tighten it). Build one with :meth:`from_settings`.
    """

    worker: str
    orchestrator: OrchestratorSettings = field(default_factory=OrchestratorSettings)
    interval_seconds: float = TICK_INTERVAL_SECONDS
    max_slots_per_tick: int = MAX_SLOTS_PER_TICK

    def __post_init__(self) -> None:
        if self.interval_seconds <= 0 or self.max_slots_per_tick < 1:
            raise ValueError("interval_seconds must be positive and max_slots_per_tick >= 1")

    @classmethod
    def from_settings(cls, settings: Settings, worker: str) -> TickerConfig:
        """The ``[orchestrator]`` section's values, for the process named ``worker``."""
        return cls(worker, settings.orchestrator)

    @property
    def fire_open_seconds(self) -> float:
        """How long a scheduled fire may stay unfinished before it is taken for dead."""
        return self.orchestrator.wall_clock_seconds + FIRE_MARGIN_SECONDS


@dataclass
class Ticked:
    """What one tick did (slots fired, skipped, missed; roots cancelled; what started)."""

    fired: int = 0
    skipped: int = 0
    missed: int = 0
    cancelled: int = 0
    roots: list[uuid.UUID] = field(default_factory=list)
    fires: list[int] = field(default_factory=list)

    def add(self, other: Ticked) -> None:
        """Count ``other``'s slots too."""
        self.fired += other.fired
        self.skipped += other.skipped
        self.missed += other.missed
        self.cancelled += other.cancelled
        self.roots += other.roots
        self.fires += other.fires

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        return {"fired": self.fired, "skipped": self.skipped, "missed": self.missed,
                "cancelled": self.cancelled, "roots": [str(r) for r in self.roots],
                "fires": list(self.fires)}


class Ticker:
    """Fires due slots: :meth:`run_once` by hand, or :meth:`start` in a thread."""

    def __init__(self, store: Store, config: TickerConfig,
                 start_fire: FireStarter | None = None) -> None:
        self.store = store
        self.config = config
        self.start_fire = start_fire
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: set[int] = set()

    # ------------------------------------------------------------------ entry points
    def run_once(self) -> Ticked:
        """One tick over every due schedule."""
        done = Ticked()
        for schedule_id in self.store.schedules.due(self.start_fire is not None,
                                                    MAX_SCHEDULES_PER_TICK):
            one = Ticked()  # counted only once its transaction committed
            try:
                with self.store.schedules.tick(self.config.worker, schedule_id) as tick:
                    if tick is not None:
                        self._tick(tick, one)
            except Exception:
                if schedule_id not in self._failing:  # once until it works again
                    log.exception("schedule tick failed", extra={"schedule_id": schedule_id})
                    self._failing.add(schedule_id)
                continue
            self._failing.discard(schedule_id)
            self._start_fires(one.fires)
            done.add(one)
        return done

    def run_now(self, name: str) -> Ticked:
        """Fire an extra slot of schedule ``name`` now (its overlap policy holds).

        Raises:
            NotFound: no such schedule.

        """
        done = Ticked()
        with self.store.schedules.tick(self.config.worker, name=name) as tick:
            assert tick is not None
            self._fire_slots(tick, (tick.row["db_now"],), done)
        self._start_fires(done.fires)
        return done

    def start(self) -> None:
        """Tick every ``interval_seconds`` in a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="schedule-ticker",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (a tick in progress finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                done = self.run_once()
                if done.fired or done.missed:
                    log.info("schedules ticked", extra=done.as_dict())
                if failing:
                    log.warning("schedule ticks work again")
                failing = False
            except Exception as exc:  # the database is away: the next tick tries again
                if not failing:  # once per outage, not twice a second
                    log.warning("schedule tick failed (retrying every tick): %s",
                                one_line(exc, 300))
                failing = True
            # Jittered, so that the processes' ticks do not fall in step.
            self._stop.wait(self.config.interval_seconds * random.uniform(0.75, 1.25))

    # ------------------------------------------------------------------ one schedule
    def _tick(self, tick: SlotWriter, done: Ticked) -> None:
        row = tick.row
        plan = plan_slots(cadence_of(row), row["next_at"], row["db_now"],
                          row["catchup_seconds"], self.config.max_slots_per_tick)
        if plan.missed and plan.missed_from is not None:
            many = "at least " if plan.missed >= MAX_COUNTED_SLOTS else ""
            tick.record(plan.missed_from, "missed", slots=plan.missed,
                        detail=f"{many}{plan.missed} slot(s) passed while no process ticked, "
                               f"older than the catch-up window ({row['catchup_seconds']:g}s)")
            done.missed += plan.missed
        self._fire_slots(tick, plan.due, done)
        tick.advance(plan.next_at)

    def _fire_slots(self, tick: SlotWriter, slots: tuple[dt.datetime, ...],
                    done: Ticked) -> None:
        row = tick.row
        if row["overlap"] == "cancel_previous" and len(slots) > 1:
            for slot in slots[:-1]:  # each would cancel the one before: the newest wins
                if tick.record(slot, "skipped", "replaced by a later slot of the same tick "
                                                "(overlap cancel_previous)"):
                    done.skipped += 1
            slots = slots[-1:]
        for slot in slots:
            if row["overlap"] != "allow" and not self._overlap_allows(tick, slot, done):
                continue
            if row["kind"] == "goal":
                root_id = tick.fire_goal(slot, task_of(row["task"]))
                if root_id is not None:
                    done.roots.append(root_id)
                    done.fired += 1
            else:
                fire_id = tick.fire_fire(slot)
                if fire_id is not None:
                    done.fires.append(fire_id)
                    done.fired += 1

    def _overlap_allows(self, tick: SlotWriter, slot: dt.datetime, done: Ticked) -> bool:
        """Apply ``skip`` or ``cancel_previous`` to what the schedule started that is open."""
        open_runs = tick.open_runs(self.config.fire_open_seconds)
        if not open_runs:
            return True
        name = tick.row["name"]
        if tick.row["overlap"] == "skip":
            last = open_runs[-1]
            what = (f"root {last['root_id']}" if last["root_id"] is not None
                    else f"fire {last['fire_id']}")
            if tick.record(slot, "skipped", f"{what} (slot {last['slot_at'].isoformat()}) is "
                                            "still open (overlap skip)"):
                done.skipped += 1
            return False
        for run in open_runs:  # cancel_previous: through the one cancel a person uses
            try:
                self.store.steering.cancel(run["root_id"], actor=f"schedule:{name}",
                                           note=f"replaced by the slot of {slot.isoformat()}")
                done.cancelled += 1
            except NotFound:  # pruned since
                pass
        return True

    def _start_fires(self, fire_ids: list[int]) -> None:
        for fire_id in fire_ids:
            if self.start_fire is not None:
                self.start_fire(fire_id)
