"""Slot computation: cron lines in a time zone (DST both ways), every N seconds, catch-up."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest

from runtime.errors import BadInput
from runtime.schedules.slots import MIN_CATCHUP_SECONDS, Cadence, plan_slots
from runtime.schedules.spec import ScheduleSpec, parse_cadence, parse_window

UTC = dt.UTC
BERLIN = "Europe/Berlin"


def at(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def slots(cadence: Cadence, start: dt.datetime, n: int) -> list[dt.datetime]:
    out = []
    for _ in range(n):
        start = cadence.next_after(start)
        out.append(start)
    return out


def test_a_cron_line_in_utc_gives_the_next_slots_strictly_after() -> None:
    c = Cadence(cron="0 7 * * *")
    assert slots(c, at(2026, 12, 6, 7, 0), 2) == [at(2026, 12, 7, 7), at(2026, 12, 8, 7)]
    assert c.next_after(at(2026, 12, 6, 6, 59, 59, 999999)) == at(2026, 12, 6, 7)
    assert c.first_at_or_after(at(2026, 12, 6, 7)) == at(2026, 12, 6, 7)


def test_a_cron_line_is_read_in_its_time_zone() -> None:
    c = Cadence(cron="0 7 * * *", timezone=BERLIN)
    assert c.next_after(at(2026, 12, 6, 12)) == at(2026, 12, 7, 6)  # CET: UTC+1
    assert c.next_after(at(2026, 7, 1, 12)) == at(2026, 7, 2, 5)  # CEST: UTC+2


def test_a_slot_in_the_skipped_spring_hour_runs_when_the_clocks_moved_on() -> None:
    c = Cadence(cron="30 2 * * *", timezone=BERLIN)  # 2026-03-29 02:00 -> 03:00
    assert slots(c, at(2026, 3, 28, 12), 2) == [at(2026, 3, 29, 1), at(2026, 3, 30, 0, 30)]


def test_a_fixed_hour_runs_once_in_the_repeated_autumn_hour() -> None:
    c = Cadence(cron="30 2 * * *", timezone=BERLIN)  # 2026-10-25 03:00 -> 02:00
    assert slots(c, at(2026, 10, 24, 12), 2) == [at(2026, 10, 25, 0, 30),
                                                 at(2026, 10, 26, 1, 30)]


def test_an_hourly_wildcard_runs_in_both_passes_of_the_autumn_hour() -> None:
    c = Cadence(cron="*/30 * * * *", timezone=BERLIN)
    got = slots(c, at(2026, 10, 24, 23, 50), 6)
    assert got == [at(2026, 10, 25, 0), at(2026, 10, 25, 0, 30), at(2026, 10, 25, 1),
                   at(2026, 10, 25, 1, 30), at(2026, 10, 25, 2), at(2026, 10, 25, 2, 30)]
    assert all((b - a) == dt.timedelta(minutes=30) for a, b in itertools.pairwise(got))


def test_every_slots_are_multiples_of_the_interval_since_the_epoch() -> None:
    c = Cadence(every_seconds=30)
    assert c.next_after(at(2026, 1, 1)) == at(2026, 1, 1, 0, 0, 30)
    assert c.next_after(at(2026, 1, 1, 0, 0, 29, 999)) == at(2026, 1, 1, 0, 0, 30)
    assert c.interval_seconds(at(2026, 1, 1)) == 30
    hourly = Cadence(every_seconds=3600)
    assert hourly.next_after(at(2026, 1, 1, 0, 10)) == at(2026, 1, 1, 1)


def test_the_interval_of_a_cron_line_is_read_from_its_slots() -> None:
    assert Cadence(cron="*/5 * * * *").interval_seconds(at(2026, 1, 1)) == 300
    assert Cadence(cron="0 7 * * *").interval_seconds(at(2026, 1, 1)) == 86400


@pytest.mark.parametrize(("cron", "every", "tz", "message"), [
    ("61 * * * *", None, None, "bad cron line"),
    ("0 7 * *", None, None, "five fields"),
    ("* * * * * *", None, None, "five fields"),
    (None, "5x", None, "bad interval"),
    (None, "0s", None, "bad interval"),
    (None, "1.5s", None, "whole seconds"),
    ("0 7 * * *", None, "Mars/Olympus", "unknown time zone"),
    (None, "5m", BERLIN, "--timezone applies to --cron only"),
    (None, None, None, "exactly one of --cron and --every"),
    ("0 7 * * *", "5m", None, "exactly one of --cron and --every"),
])
def test_bad_cadences_are_refused_with_a_clear_message(cron: str | None, every: str | None,
                                                       tz: str | None, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        parse_cadence(cron, every, tz)


def test_bad_specs_are_refused() -> None:
    every = Cadence(every_seconds=60)
    with pytest.raises(BadInput, match="bad schedule name"):
        ScheduleSpec("no spaces", every, None)
    with pytest.raises(BadInput, match="bad --overlap"):
        ScheduleSpec("x", every, None, overlap="sometimes")
    with pytest.raises(BadInput, match="cancel_previous applies to goal schedules"):
        ScheduleSpec("x", every, None, overlap="cancel_previous")
    with pytest.raises(BadInput, match="--catchup-window"):
        parse_window("an hour")
    assert parse_window("1h") == 3600 and parse_window(None) == 60


def test_a_tick_on_time_fires_the_due_slot_and_moves_on() -> None:
    c = Cadence(every_seconds=60)
    plan = plan_slots(c, at(2026, 1, 1, 0, 1), at(2026, 1, 1, 0, 1, 0, 300000), 60)
    assert plan.due == (at(2026, 1, 1, 0, 1),) and plan.missed == 0
    assert plan.next_at == at(2026, 1, 1, 0, 2)


def test_slots_missed_within_the_window_fire_once_each_the_older_are_counted() -> None:
    c = Cadence(every_seconds=60)
    plan = plan_slots(c, at(2026, 1, 1, 0, 0), at(2026, 1, 1, 1, 0, 30), 600)
    assert plan.missed_from == at(2026, 1, 1, 0, 0) and plan.missed == 51  # 00:00 .. 00:50
    assert plan.due == (*(at(2026, 1, 1, 0, m) for m in range(51, 60)), at(2026, 1, 1, 1))
    assert plan.next_at == at(2026, 1, 1, 1, 1)


def test_a_late_tick_never_counts_a_fresh_slot_missed() -> None:
    c = Cadence(every_seconds=1)
    late = at(2026, 1, 1, 0, 0, int(MIN_CATCHUP_SECONDS) - 1)
    plan = plan_slots(c, at(2026, 1, 1), late, catchup_seconds=0)
    assert plan.missed == 0 and plan.due[0] == at(2026, 1, 1)


def test_a_long_catch_up_is_spread_over_ticks() -> None:
    c = Cadence(every_seconds=1)
    plan = plan_slots(c, at(2026, 1, 1), at(2026, 1, 1, 1), 3600, limit=100)
    assert len(plan.due) == 100 and plan.next_at == at(2026, 1, 1, 0, 1, 40)
