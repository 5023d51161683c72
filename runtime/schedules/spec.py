"""What a schedule is, checked before anything is stored: ``orgchart schedule add``'s input.

A :class:`ScheduleSpec` holds a name, a :class:`~runtime.schedules.slots.Cadence`, what
each slot starts (a root goal, validated like ``orgchart submit``'s: the agent exists,
the payload fits its schema, budgets are sane; or, with no task, the orchestrator's
fire), the overlap policy and the catch-up window. Every check raises
:class:`~runtime.errors.BadInput` with a message naming the option, so the CLI exits 2
and the API answers 422, and nothing is written.

The stored form of the root is :func:`task_columns` (read back by :func:`task_of`).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from runtime.errors import BadInput
from runtime.schedules.slots import Cadence
from runtime.store.rows import NewTask
from runtime.wiring import parse_duration

#: A schedule's name: like a tenant's (letters, digits, '_', '.', '-'; at most 64).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
OVERLAPS = ("skip", "allow", "cancel_previous")
#: Slots missed while nothing ticked are fired if they are at most this old.
DEFAULT_CATCHUP_SECONDS = 60.0
#: The longest catch-up window (a week): past it, missed slots are only counted.
MAX_CATCHUP_SECONDS = 7 * 86400.0


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule to store; validated on creation (:class:`BadInput` naming the option).

    Attributes:
        name: unique among schedules.
        cadence: when its slots fall.
        task: the root each slot inserts; None for the orchestrator's fire.
        overlap: ``skip`` (no new root while one it started is open), ``allow``, or
            ``cancel_previous`` (the open one is cancelled; goal schedules only).
        catchup_seconds: how old a missed slot may be and still fire.

    """

    name: str
    cadence: Cadence
    task: NewTask | None
    overlap: str = "skip"
    catchup_seconds: float = DEFAULT_CATCHUP_SECONDS

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_PATTERN.match(self.name):
            raise BadInput(f"bad schedule name {self.name!r}: letters, digits, '_', '.', '-' "
                           "(at most 64, starting with a letter or digit)")
        if self.overlap not in OVERLAPS:
            raise BadInput(f"bad --overlap {self.overlap!r}: use one of {', '.join(OVERLAPS)}")
        if self.task is None and self.overlap == "cancel_previous":
            raise BadInput("--overlap cancel_previous applies to goal schedules: a fire is "
                           "stopped by its own wall clock")
        if not 0 <= self.catchup_seconds <= MAX_CATCHUP_SECONDS:
            raise BadInput(f"--catchup-window must be between 0s and 7d (got "
                           f"{self.catchup_seconds:g}s)")
        if self.task is not None and self.task.idempotency_key is not None:
            raise BadInput("--idempotency-key does not apply to a schedule: each slot is a "
                           "new root, recorded once by the slot's own key")

    @property
    def kind(self) -> str:
        """``goal`` or ``fire``."""
        return "fire" if self.task is None else "goal"

    def columns(self, now: dt.datetime, created_by: str) -> dict[str, Any]:
        """The stored row: its first slot is the first after ``now``."""
        return {"name": self.name, "cron": self.cadence.cron,
                "every_seconds": self.cadence.every_seconds,
                "timezone": self.cadence.timezone, "kind": self.kind,
                "task": None if self.task is None else task_columns(self.task),
                "overlap": self.overlap, "catchup_seconds": self.catchup_seconds,
                "next_at": self.cadence.next_after(now), "created_by": created_by}


def parse_cadence(cron: str | None, every: str | None, timezone: str | None) -> Cadence:
    """A cadence from ``--cron`` (with ``--timezone``) or ``--every``; :class:`BadInput` if bad."""
    if (cron is None) == (every is None):
        raise BadInput("give exactly one of --cron and --every")
    seconds = None
    if every is not None:
        try:
            seconds = parse_duration(every).total_seconds()
        except BadInput:
            raise BadInput(f"bad interval {every!r} for --every: use a whole number of "
                           "seconds, minutes, hours or days (e.g. 30s, 5m, 1h)") from None
    return Cadence(cron=cron, every_seconds=seconds, timezone=timezone or "UTC")


def parse_window(text: str | None) -> float:
    """``--catchup-window`` (``1h``, ``0s``) in seconds; the default when not given."""
    if text is None:
        return DEFAULT_CATCHUP_SECONDS
    try:
        return parse_duration(text).total_seconds()
    except BadInput:
        raise BadInput(f"bad --catchup-window {text!r}: use a number and s, m, h or d "
                       "(e.g. 1h)") from None


def task_columns(task: NewTask) -> dict[str, Any]:
    """A root as stored on its schedule (JSON)."""
    return {"to_agent": task.to_agent, "type": task.type, "payload": task.payload,
            "priority": task.priority, "budget_tokens": task.budget_tokens,
            "budget_seconds": task.budget_seconds, "budget_usd": str(task.budget_usd),
            "success_criteria": task.success_criteria, "kill_criteria": task.kill_criteria,
            "tenant": task.tenant}


def task_of(stored: dict[str, Any]) -> NewTask:
    """The root a slot inserts, from its schedule's stored ``task``."""
    return NewTask(**{**stored, "budget_usd": Decimal(str(stored["budget_usd"]))})


def cadence_of(row: dict[str, Any]) -> Cadence:
    """A stored schedule's cadence."""
    return Cadence(cron=row["cron"], every_seconds=row["every_seconds"],
                   timezone=row["timezone"])
