"""How much a sync worker holds: four tasks a thread, plus a quarter second at its pace."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from runtime.config import Settings
from runtime.engine.worker.agent_threads import SyncAgentRunner
from runtime.engine.worker.scheduler import Scheduler
from runtime.engine.worker.settings import (
    HOLD_AHEAD_SECONDS,
    SYNC_PREFETCH,
    WorkerConfig,
    WorkerStats,
)
from runtime.engine.worker.state import DbHealth, Held, Pace, Wake


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pace_counts_the_tasks_ended_within_its_window_only() -> None:
    clock = Clock()
    pace = Pace(window=0.2, clock=clock)
    assert pace.per_second() == 0.0
    pace.note(10)
    clock.now += 0.1
    pace.note(30)
    assert pace.per_second() == 200.0  # 40 tasks over a 0.2 s window
    clock.now += 0.15
    assert pace.per_second() == 150.0  # the first 10 are older than the window now
    clock.now += 0.1
    assert pace.per_second() == 0.0
    pace.note(5)
    assert pace.per_second() == 25.0


def _scheduler(threads: int, max_in_flight: int = 1000) -> Scheduler:
    config = WorkerConfig.from_settings(Settings(), ("noop",), sync_threads=threads,
                                        max_in_flight=max_in_flight)
    runner = SyncAgentRunner(SimpleNamespace(), threads)  # type: ignore[arg-type]
    return Scheduler(SimpleNamespace(), runner, config, Held(), Wake(),  # type: ignore[arg-type]
                     DbHealth(WorkerStats()), threading.Event(), lambda reason: None)


def test_a_sync_worker_holds_more_when_its_tasks_end_quickly_up_to_max_in_flight() -> None:
    scheduler = _scheduler(threads=8)
    scheduler.pace = Pace(clock=Clock())  # no time passes: every note is in the window
    assert scheduler.limit == 8 * SYNC_PREFETCH  # no pace yet: four a thread
    scheduler.pace.note(400)  # 400 tasks ended in the last second
    assert scheduler.limit == 8 * SYNC_PREFETCH + int(400 * HOLD_AHEAD_SECONDS)
    scheduler.pace.note(100_000)
    assert scheduler.limit == 1000  # never past max_in_flight
