"""When a schedule's slots fall: a cron line in a time zone, or every N seconds.

A :class:`Cadence` answers one question, :meth:`Cadence.next_after`: the first slot
strictly after an instant, in UTC. Cron lines are read by ``croniter`` (five fields:
minute hour day-of-month month day-of-week) in the schedule's ``zoneinfo`` time zone;
``every`` slots are whole multiples of the interval since the Unix epoch, so every
process and host computes the same instants without agreeing on a start.

Daylight saving time, as Vixie cron does it: a slot in the hour skipped in spring runs
when the clocks have moved on (02:30 runs at 03:00); in the hour repeated in autumn, a
line with a fixed hour runs once (the first 02:30), while a line whose hour field is
``*`` (``*/30 * * * *``) runs in both passes, since its interval is real time.

:func:`plan_slots` splits the slots a tick finds due into those older than the catch-up
window (recorded as missed, counted) and those to fire, at most ``limit`` of them.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from runtime.errors import BadInput

UTC = dt.UTC
EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)
#: The shortest ``every`` interval.
MIN_EVERY_SECONDS = 1
#: A slot is never counted missed within this many seconds of its time, whatever the
#: catch-up window: a tick that is merely late (a busy host, a slow transaction) fires it.
MIN_CATCHUP_SECONDS = 10.0
#: Most slots a missed run is counted up to, one by one, for a cron line (an ``every``
#: cadence counts by arithmetic); past it the count stops, and its row says "at least".
MAX_COUNTED_SLOTS = 100_000


@dataclass(frozen=True)
class Cadence:
    """A schedule's cadence: ``cron`` (in ``timezone``) or ``every_seconds``; validated."""

    cron: str | None = None
    every_seconds: float | None = None
    timezone: str = "UTC"
    _zone: ZoneInfo = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.every_seconds is None):
            raise BadInput("a schedule needs exactly one of --cron and --every")
        try:
            zone = ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise BadInput(f"unknown time zone {self.timezone!r}: use an IANA name such as "
                           "Europe/Berlin or UTC") from None
        object.__setattr__(self, "_zone", zone)
        if self.cron is not None:
            fields = self.cron.split()
            if len(fields) != 5 or not croniter.is_valid(self.cron):
                raise BadInput(f"bad cron line {self.cron!r}: use five fields, minute hour "
                               "day-of-month month day-of-week (e.g. '0 7 * * *')")
        else:
            every = self.every_seconds
            if every is None or every < MIN_EVERY_SECONDS or every != int(every):
                raise BadInput(f"bad interval {every!r}: --every takes whole seconds, at "
                               f"least {MIN_EVERY_SECONDS}s (e.g. 30s, 5m, 1h)")
            if self.timezone != "UTC":
                raise BadInput("--timezone applies to --cron only: --every counts real time")

    def next_after(self, at: dt.datetime) -> dt.datetime:
        """The first slot strictly after ``at`` (an aware datetime), in UTC."""
        if self.every_seconds is not None:
            step = int(self.every_seconds) * 1_000_000
            micros = (at - EPOCH) // dt.timedelta(microseconds=1)
            return EPOCH + dt.timedelta(microseconds=(micros // step + 1) * step)
        return self._next_cron(at)

    def _next_cron(self, at: dt.datetime) -> dt.datetime:
        assert self.cron is not None
        fixed_hour = self.cron.split()[1] != "*"
        local = at.astimezone(self._zone)
        # croniter works in whole seconds: start a second early, skip what is not after.
        it = croniter(self.cron, local.replace(microsecond=0) - dt.timedelta(seconds=1))
        while True:
            slot: dt.datetime = it.get_next(dt.datetime)
            if slot.astimezone(UTC) <= at:
                continue
            if fixed_hour and _second_pass(slot):
                continue  # the repeated autumn hour: a fixed-hour line ran in the first
            return slot.astimezone(UTC)

    def first_at_or_after(self, at: dt.datetime) -> dt.datetime:
        """The first slot at or after ``at``."""
        return self.next_after(at - dt.timedelta(microseconds=1))

    def interval_seconds(self, at: dt.datetime) -> float:
        """The time between the first two slots after ``at`` (doctor's expected interval)."""
        first = self.next_after(at)
        return (self.next_after(first) - first).total_seconds()

    def describe(self) -> str:
        """``cron '0 7 * * *' (Europe/Berlin)`` or ``every 30s``."""
        if self.cron is not None:
            return f"cron {self.cron!r} ({self.timezone})"
        return f"every {_seconds(float(self.every_seconds or 0))}"


def _second_pass(local: dt.datetime) -> bool:
    """True when ``local`` is the second occurrence of a wall-clock time (autumn's hour)."""
    return local.fold == 1 and local.replace(fold=0).utcoffset() != local.utcoffset()


def _seconds(seconds: float) -> str:
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class SlotPlan:
    """What a tick does with a schedule's due slots.

    Attributes:
        missed_from: the first slot older than the catch-up window (None if none).
        missed: how many slots from ``missed_from`` are older than the window.
        due: the slots to fire, oldest first.
        next_at: the schedule's first slot left unhandled.

    """

    missed_from: dt.datetime | None
    missed: int
    due: tuple[dt.datetime, ...]
    next_at: dt.datetime


def plan_slots(cadence: Cadence, next_at: dt.datetime, now: dt.datetime,
               catchup_seconds: float, limit: int = 1000) -> SlotPlan:
    """Split the slots from ``next_at`` up to ``now`` into missed ones and ones to fire.

    A slot older than ``now`` minus the catch-up window (never less than
    :data:`MIN_CATCHUP_SECONDS`) is missed; the others are fired, at most ``limit`` in a
    tick (the rest are the next tick's: ``next_at`` is the first of them).
    """
    window = dt.timedelta(seconds=max(catchup_seconds, MIN_CATCHUP_SECONDS))
    slot = cadence.first_at_or_after(next_at)
    missed_from, missed = None, 0
    if slot < now - window:
        missed_from = slot
        start = cadence.first_at_or_after(now - window)
        missed = _count(cadence, slot, start)
        slot = start
    due: list[dt.datetime] = []
    while slot <= now and len(due) < limit:
        due.append(slot)
        slot = cadence.next_after(slot)
    return SlotPlan(missed_from, missed, tuple(due), slot)


def _count(cadence: Cadence, first: dt.datetime, end: dt.datetime) -> int:
    """How many slots from ``first`` (included) to ``end`` (excluded)."""
    if cadence.every_seconds is not None:
        return int((end - first).total_seconds() // cadence.every_seconds)
    n, slot = 0, first
    while slot < end and n < MAX_COUNTED_SLOTS:
        n += 1
        slot = cadence.next_after(slot)
    return n
