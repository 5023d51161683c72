"""``POST /schedules``'s body: every rule the schedule commands check, as a schema.

A cron line is five fields of numbers, ranges, lists, steps and ``*`` (month and day
names too: ``jan``, ``MON``, ``Mon``), the grammar :func:`cron_pattern` spells out;
croniter (what the schedules run on) reads every line it matches. An interval is a
whole number and a unit (``30s``, ``5m``, ``1h``, ``2d``, ``1w``); a catch-up window is
the same, from ``0s`` to ``7d``. Exactly one of ``goal`` and ``fire``, exactly one of
``cron`` and ``every``, ``timezone`` with ``cron`` only, ``cancel_previous`` with a goal
only: each is a ``oneOf`` or ``not`` in the document and a check in
:meth:`ScheduleRequest._one_of_each`.
"""

from __future__ import annotations

import datetime as dt
import zoneinfo
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from runtime.constants import TENANT_NAME_PATTERN
from runtime.http.constraints import (
    Bool,
    Int,
    JsonObject,
    KillCriteria,
    NonBlankText,
    Seconds,
    SuccessCriteria,
    Tokens,
    Usd,
    describe_pattern,
)
from runtime.wiring import MAX_GOAL_CHARS

_MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
#: A schedule's name (as ``runtime.schedules.spec.NAME_PATTERN``).
NAME_PATTERN = describe_pattern(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
                                "is a bad schedule name: letters, digits, '_', '.', '-' "
                                "(at most 64, starting with a letter or digit)")
#: ``every``: whole seconds, at least one, at most 99999 of a unit (no date overflows).
EVERY_PATTERN = describe_pattern(r"^[1-9][0-9]{0,4}[smhdw]$",
                                 "is a bad interval: a whole number of seconds, minutes, "
                                 "hours, days or weeks, from 1 to 99999 (e.g. 30s, 5m, 1h)")
#: ``catchup_window``: 0s to 7d, in any one unit.
WINDOW_PATTERN = describe_pattern(
    "^(?:(?:604800|604[0-7][0-9]{2}|60[0-3][0-9]{3}|[1-5]?[0-9]{1,5})s"
    "|(?:10080|100[0-7][0-9]|[0-9]{1,4})m|(?:16[0-8]|1[0-5][0-9]|[0-9]{1,2})h"
    "|[0-7]d|[01]w)$",
    "is a bad catch-up window: a whole number and s, m, h, d or w, from 0s to 7d (e.g. 1h)")


def _alternatives(*choices: str) -> str:
    return "(?:" + "|".join(choices) + ")"


def _names(words: list[str]) -> list[str]:
    return [form for word in words for form in (word, word.upper(), word.capitalize())]


def cron_pattern() -> str:
    """The cron lines the API takes: five fields, each a list of ``*``, values, ranges."""
    values = (r"[0-5]?[0-9]", r"(?:[01]?[0-9]|2[0-3])", r"(?:0?[1-9]|[12][0-9]|3[01])",
              _alternatives(r"0?[1-9]|1[0-2]", *_names(_MONTHS)),
              _alternatives(r"[0-7]", *_names(_DAYS)))
    fields = []
    for value in values:
        item = _alternatives(r"\*", f"{value}(?:-{value})?") + r"(?:/[1-9][0-9]?)?"
        fields.append(f"{item}(?:,{item})*")
    return "^" + " ".join(fields) + "$"


CRON_PATTERN = describe_pattern(cron_pattern(),
                                "is a bad cron line: use five fields, minute hour "
                                "day-of-month month day-of-week (e.g. '0 7 * * *')")
#: The IANA zones this machine knows (``zoneinfo``): the ``timezone`` values taken.
TIME_ZONES = sorted(zoneinfo.available_timezones())

TimeZone = Annotated[str, WithJsonSchema({"type": "string", "enum": TIME_ZONES})]

#: Exactly one of goal and fire; exactly one of cron and every; the rest follows.
_ONE_OF_EACH: dict[str, Any] = {
    "allOf": [
        {"oneOf": [
            {"required": ["goal"], "properties": {"goal": {"type": "string"},
                                                  "fire": {"const": False}}},
            {"required": ["fire"], "properties": {
                "fire": {"const": True}, "goal": {"type": "null"},
                "overlap": {"enum": ["skip", "allow"]}, "payload": {"type": "null"},
                "success_criteria": {"type": "null"}, "kill_criteria": {"type": "null"}}},
        ]},
        {"oneOf": [
            {"required": ["cron"], "properties": {"cron": {"type": "string"},
                                                  "every": {"type": "null"}}},
            {"required": ["every"], "properties": {"every": {"type": "string"},
                                                   "cron": {"type": "null"},
                                                   "timezone": {"type": "null"}}},
        ]},
    ],
}


class ScheduleRequest(BaseModel):
    """``POST /schedules``: a cadence, and a goal or the fire."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_ONE_OF_EACH)

    name: str = Field(pattern=NAME_PATTERN,
                      description="Unique; letters, digits, '_', '.', '-' (at most 64).")
    cron: str | None = Field(None, pattern=CRON_PATTERN,
                             description="A cron line: '0 7 * * *' (a line that never falls, "
                                         "such as February 30th, is refused).")
    timezone: TimeZone | None = Field(None, description="The cron line's IANA time zone.")
    every: str | None = Field(None, pattern=EVERY_PATTERN,
                              description="An interval instead: 30s, 5m, 1h, 2d, 1w.")
    goal: NonBlankText | None = Field(None, max_length=MAX_GOAL_CHARS,
                                      description="The goal of the root each slot starts.")
    fire: Bool = Field(False, description="Each slot runs the orchestrator's fire instead.")
    agent: str = Field("ceo", description="The agent that receives the goal.")
    payload: JsonObject | None = Field(None, description="Extra payload (the agent's "
                                                         "input schema: see the oneOf).")
    tenant: str = Field("default", pattern=TENANT_NAME_PATTERN)
    priority: Int = Field(5, ge=-1000, le=1000)
    budget_tokens: Tokens | None = None
    budget_seconds: Seconds | None = None
    budget_usd: Usd | None = None
    success_criteria: SuccessCriteria | None = None
    kill_criteria: KillCriteria | None = None
    overlap: Literal["skip", "allow", "cancel_previous"] = "skip"
    catchup_window: str | None = Field(None, pattern=WINDOW_PATTERN,
                                       description="Default 1m: from 0s to 7d, e.g. 1h.")

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str | None) -> str | None:
        if value is not None and value not in TIME_ZONES:
            raise ValueError(f"unknown time zone {value!r}: use an IANA name such as "
                             "Europe/Berlin or UTC")
        return value

    @model_validator(mode="after")
    def _one_of_each(self) -> ScheduleRequest:
        if (self.goal is None) == (not self.fire):
            raise ValueError("give exactly one of goal and fire")
        if (self.cron is None) == (self.every is None):
            raise ValueError("give exactly one of cron and every")
        if self.every is not None and self.timezone is not None:
            raise ValueError("timezone applies to cron only: every counts real time")
        if self.fire and self.overlap == "cancel_previous":
            raise ValueError("overlap cancel_previous applies to goal schedules: a fire is "
                             "stopped by its own wall clock")
        given = [name for name in ("payload", "success_criteria", "kill_criteria")
                 if getattr(self, name) is not None]
        if self.fire and given:
            raise ValueError(f"{', '.join(given)} apply to goal schedules, not to the fire")
        return self


def never_falls(cron: str, timezone: str | None) -> bool:
    """Whether a cron line that reads well has no slot at all (``0 0 30 2 *``)."""
    from croniter import CroniterBadDateError

    from runtime.schedules.slots import Cadence

    try:
        Cadence(cron=cron, timezone=timezone or "UTC").next_after(dt.datetime.now(dt.UTC))
    except CroniterBadDateError:
        return True
    return False
