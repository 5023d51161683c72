"""Schedules against a real PostgreSQL: exactly once across concurrent tickers, overlap,
catch-up, pause, run-now, a late schedule in ``doctor``, and bad input that stores nothing.

Concurrent tickers are threads, each with its own Store (its own connections), ticking
the same due slots at once; whatever the interleaving, each slot is recorded once and
each fired slot has exactly one root.
"""

from __future__ import annotations

import datetime as dt
import itertools
import threading
import time
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from runtime.config import Settings
from runtime.errors import BadInput
from runtime.fleet.doctor import DoctorLimits, check
from runtime.fleet.orchestrator import FIRE_LOCK_KEY, FireConfig, Orchestrator
from runtime.schedules.commands import add_schedule, pause_schedule, resume_schedule, run_now
from runtime.schedules.spec import ScheduleSpec, parse_cadence
from runtime.schedules.ticker import Ticker, TickerConfig
from runtime.store.postgres import engines
from runtime.store.rows import NewTask
from runtime.store.store import Store

THREADS = 6
SCHEDULES = 4
TICK_FOR_SECONDS = 2.5


def _task(goal: str = "scheduled") -> NewTask:
    return NewTask(to_agent="noop", type="noop", payload={"goal": goal},
                   budget_usd=Decimal("1"))


def _store_schedule(store: Store, name: str, *, every: str = "1s", overlap: str = "allow",
                    catchup: float = 60.0, behind: float = 0.0,
                    task: NewTask | None = None, fire: bool = False) -> dict[str, Any]:
    """A schedule whose first slot is ``behind`` seconds in the past."""
    spec = ScheduleSpec(name, parse_cadence(None, every, None), None if fire else
                        (task or _task()), overlap, catchup)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=behind)
    return store.schedules.create(spec.columns(now, "test"))


def _runs(store: Store, name: str) -> list[dict[str, Any]]:
    return list(reversed(store.schedules.runs(name, 100_000)))


def _ticker(store: Store, name: str = "test") -> Ticker:
    return Ticker(store, TickerConfig(worker=name))


def _roots(store: Store) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(
            "SELECT id, status, created_at FROM tasks WHERE parent_id IS NULL")).mappings()]


def test_each_slot_fires_exactly_once_across_concurrent_tickers(db_url: str,
                                                                 store: Store) -> None:
    names = [f"every-second-{i}" for i in range(SCHEDULES)]
    for name in names:
        _store_schedule(store, name, behind=20)
    stores = [Store(engines.create_db_engine(db_url, pool_size=2)) for _ in range(THREADS)]
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def tick(s: Store, n: int) -> None:
        # A few slots per tick, so a catch-up is shared out among the tickers.
        ticker = Ticker(s, TickerConfig(worker=f"t{n}", max_slots_per_tick=3))
        try:
            barrier.wait()
            end = time.monotonic() + TICK_FOR_SECONDS
            while time.monotonic() < end:
                ticker.run_once()
                time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=tick, args=(s, n)) for n, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in stores:
        s.dispose()
    assert not errors
    workers: set[str] = set()
    all_runs = []
    for name in names:
        runs = _runs(store, name)
        slots = [r["slot_at"] for r in runs]
        assert len(slots) == len(set(slots)) >= 20
        assert all(r["state"] == "fired" for r in runs)
        # consecutive: no slot between the first and the last was left out
        assert all((b - a) == dt.timedelta(seconds=1) for a, b in itertools.pairwise(slots))
        workers |= {r["worker"] for r in runs}
        all_runs += runs
    roots = {r["id"] for r in _roots(store)}
    assert {r["root_id"] for r in all_runs} == roots and len(roots) == len(all_runs)
    assert len(workers) > 1  # the tickers really raced


def test_a_slots_root_is_inserted_with_its_record_and_names_the_schedule(store: Store) -> None:
    _store_schedule(store, "one", every="1h", behind=3600, catchup=7200)
    done = _ticker(store).run_once()
    assert done.fired == 1 and len(done.roots) == 1
    (run,) = _runs(store, "one")
    assert run["root_id"] == done.roots[0] and run["root_status"] == "pending"
    with store.engine.connect() as conn:
        worker = conn.execute(sa.text("SELECT worker FROM task_events WHERE task_id = :id"),
                              {"id": done.roots[0]}).scalar_one()
    assert worker == "schedule:one"
    assert _ticker(store).run_once().fired == 0  # the next slot is an hour away


def test_overlap_skip_records_the_slot_skipped_while_the_last_root_is_open(
        store: Store) -> None:
    _store_schedule(store, "skipper", every="1s", overlap="skip", behind=3)
    done = _ticker(store).run_once()
    assert done.fired == 1 and done.skipped >= 2  # the first fired, the rest found it open
    states = [r["state"] for r in _runs(store, "skipper")]
    assert states[0] == "fired" and set(states[1:]) == {"skipped"}
    store.steering.cancel(done.roots[0], actor="test")  # the root ends: the next slot fires
    _wait_next_slot(store, "skipper")
    assert _ticker(store).run_once().fired == 1


def test_overlap_cancel_previous_cancels_the_open_root_through_cancel(store: Store) -> None:
    _store_schedule(store, "replacer", every="1s", overlap="cancel_previous")
    first = _fire_next(store, "replacer")
    second = _fire_next(store, "replacer")
    assert second.cancelled == 1
    statuses = {r["id"]: r["status"] for r in _roots(store)}
    assert statuses[first.roots[0]] == "cancelled" and statuses[second.roots[0]] == "pending"


def test_overlap_allow_starts_a_root_per_slot(store: Store) -> None:
    _store_schedule(store, "allower", every="1s", overlap="allow", behind=3)
    done = _ticker(store).run_once()
    assert done.fired >= 3 and done.skipped == 0
    assert len(_roots(store)) == done.fired


def test_catch_up_fires_slots_within_the_window_and_records_the_rest_missed(
        store: Store) -> None:
    _store_schedule(store, "behind", every="1s", catchup=20, behind=120)
    done = _ticker(store).run_once()
    runs = _runs(store, "behind")
    missed = [r for r in runs if r["state"] == "missed"]
    assert len(missed) == 1 and missed[0]["slots"] == done.missed
    assert 95 <= done.missed <= 101 and 19 <= done.fired <= 23
    fired = [r["slot_at"] for r in runs if r["state"] == "fired"]
    # every slot from the first to the last is accounted for: missed, then fired
    assert missed[0]["slot_at"] + dt.timedelta(seconds=missed[0]["slots"]) == fired[0]


def test_a_paused_schedule_fires_nothing_and_resumes_from_now(store: Store) -> None:
    _store_schedule(store, "napper", every="1s", behind=5)
    pause_schedule(store, "napper")
    assert _ticker(store).run_once().fired == 0
    row = resume_schedule(store, "napper")
    assert dt.datetime.fromisoformat(row["next_at"]) > dt.datetime.now(dt.UTC) - \
        dt.timedelta(seconds=2)
    assert _runs(store, "napper") == []  # the slots of the pause are not caught up


def test_run_now_fires_an_extra_slot_even_when_paused(store: Store) -> None:
    _store_schedule(store, "manual", every="1h")
    pause_schedule(store, "manual")
    done = run_now(store, Settings(), "manual")
    assert done.fired == 1 and len(_roots(store)) == 1
    assert _runs(store, "manual")[0]["state"] == "fired"


def test_a_fire_schedules_slot_writes_the_fires_row_with_it(store: Store) -> None:
    _store_schedule(store, "fire", every="1h", behind=3600, catchup=7200, fire=True,
                    overlap="skip")
    assert Ticker(store, TickerConfig(worker="t")).run_once().fired == 0  # cannot host one
    started: list[int] = []
    done = Ticker(store, TickerConfig(worker="t"), started.append).run_once()
    assert done.fired == 1 and started == done.fires
    (run,) = _runs(store, "fire")
    assert run["fire_id"] == started[0]
    assert store.fires.last()["id"] == started[0]  # type: ignore[index]


def test_bad_input_exits_with_a_message_and_stores_nothing(store: Store) -> None:
    for kwargs, message in [
        ({"cron": "0 25 * * *"}, "bad cron line"),
        ({"every": "often"}, "bad interval"),
        ({"cron": "0 7 * * *", "timezone": "Europe/Nowhere"}, "unknown time zone"),
        ({"every": "1m", "overlap": "sometimes"}, "bad --overlap"),
    ]:
        args: dict[str, Any] = {"cron": None, "every": None, "timezone": None, **kwargs}
        with pytest.raises(BadInput, match=message):
            add_schedule(store, name="bad", task=_task(), **args)
    add_schedule(store, name="taken", cron=None, every="1m", timezone=None, task=_task())
    with pytest.raises(BadInput, match="exists"):
        add_schedule(store, name="taken", cron=None, every="1m", timezone=None, task=_task())
    assert [r["name"] for r in store.schedules.all()] == ["taken"]


def test_doctor_reports_a_schedule_late_past_its_grace(store: Store) -> None:
    limits = DoctorLimits(3600, 3600)
    _store_schedule(store, "hourly", every="1h")
    store.fires.finished(store.fires.started({}), {}, {}, "")
    assert not [p for p in check(store, limits).problems if "schedule" in p]
    _store_schedule(store, "late", every="1m", behind=600)
    problems = [p for p in check(store, limits).problems if "schedule" in p]
    assert len(problems) == 1 and "'late'" in problems[0]


def _wait_next_slot(store: Store, name: str) -> None:
    """Poll until the schedule's next slot is due (at most a second: every='1s')."""
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        row = store.schedules.get(name)
        if row["next_at"] <= row["db_now"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"schedule {name} never came due")


def _fire_next(store: Store, name: str) -> Any:
    _wait_next_slot(store, name)
    done = _ticker(store).run_once()
    assert done.fired == 1
    return done


def test_a_scheduled_fire_that_cannot_run_finishes_its_row_saying_why(store: Store) -> None:
    _store_schedule(store, "fire", every="1h", behind=3600, catchup=7200, fire=True)
    started: list[int] = []
    Ticker(store, TickerConfig(worker="t"), started.append).run_once()
    orchestrator = Orchestrator(store, Settings(), FireConfig())
    with store.fires.lock(FIRE_LOCK_KEY) as locked:  # another fire is running
        assert locked
        result = orchestrator.run_once(fire_id=started[0])
    assert result.status == "locked" and result.fire_id == started[0]
    fire = store.fires.last()
    assert fire is not None and fire["id"] == started[0] and fire["finished_at"] is not None
    assert fire["rollup"] == "another fire is running; nothing done"


def test_resuming_a_schedule_that_is_not_paused_keeps_its_due_slots(store: Store) -> None:
    _store_schedule(store, "awake", every="1s", behind=5)
    before = store.schedules.get("awake")["next_at"]
    resume_schedule(store, "awake")
    assert store.schedules.get("awake")["next_at"] == before
    assert _ticker(store).run_once().fired >= 5


def test_a_schedule_whose_root_cannot_be_inserted_holds_up_no_other(store: Store) -> None:
    bad = _task()
    _store_schedule(store, "broken", every="1s", behind=2,
                    task=NewTask(bad.to_agent, bad.type, bad.payload,
                                 budget_usd=Decimal("1000000000")))  # past numeric(16, 8)
    _store_schedule(store, "fine", every="1s", behind=2)
    before = store.schedules.get("broken")["next_at"]
    done = _ticker(store).run_once()
    assert done.fired >= 2 and all(r["state"] == "fired" for r in _runs(store, "fine"))
    assert _runs(store, "broken") == [] and store.schedules.get("broken")["next_at"] == before


def test_a_scheduled_fire_that_died_unfinished_holds_up_no_later_slot(store: Store) -> None:
    _store_schedule(store, "fire", every="1s", fire=True, overlap="skip")
    started: list[int] = []
    config = TickerConfig(worker="t")  # a fire unfinished after 600 s + 300 s is dead
    _wait_next_slot(store, "fire")
    assert Ticker(store, config, started.append).run_once().fired == 1
    _wait_next_slot(store, "fire")  # its fire is unfinished, and young
    assert Ticker(store, config, started.append).run_once().skipped == 1
    with store.database.transaction() as conn:  # its process died long ago
        conn.execute(sa.text("UPDATE fires SET started_at = now() - interval '1 hour'"))
    _wait_next_slot(store, "fire")
    assert Ticker(store, config, started.append).run_once().fired == 1
    assert len(started) == 2
