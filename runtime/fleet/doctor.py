"""``orgchart doctor``: the watcher whose only job is to say when the fire did not happen.

An orchestrated fleet has one heartbeat, the fire, and its failure mode is absence: a
cron line that stopped firing makes no noise. ``doctor`` turns absence into an exit
status for a monitor to alert on. It reports a problem (one line each) when:

- the last fire started more than ``[orchestrator] expected_interval_seconds`` ago (or
  started and never finished); that no fire has ever run is information, not a problem
  (always-on workers are a way to run: their maintenance reaps and sweeps; a fire
  schedule that stops firing is caught by the schedule rule below);
- work is stranded: leases that expired with nobody to reap them, waiting parents
  whose children are all terminal (``store.reads.stranded``);
- the oldest open escalation has waited longer than ``escalation_max_age_seconds``;
- a schedule (``orgchart schedule``) is late: its next slot is more than
  :data:`SCHEDULE_GRACE_SECONDS` past and not fired (no process is ticking). With a fire
  schedule, the fire's expected interval is that schedule's, not the config's.

It only reads; it never repairs (``orgchart fire`` does, with its hygiene pass).
Failure modes: an unreachable database is itself a problem, reported by the CLI with
exit status 1 like any other.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.config import DoctorSettings, OrchestratorSettings, WebhooksSettings
from runtime.schedules.spec import cadence_of
from runtime.store.store import Store

#: How long past its time a schedule's slot may go unfired before the doctor complains
#: (every process ticks twice a second: a minute is a tick that is not happening).
SCHEDULE_GRACE_SECONDS = 60.0


@dataclass(frozen=True)
class DoctorLimits:
    """How old things may get before the doctor complains."""

    expected_interval_seconds: float
    escalation_max_age_seconds: float
    #: ``[doctor] inbox_age_alert``: questions and approvals older than this are reported.
    inbox_age_alert_seconds: float = 3600.0
    #: ``[webhooks] alert_after``: webhook events waiting longer than this are reported.
    webhook_alert_after_seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.expected_interval_seconds <= 0 or self.escalation_max_age_seconds <= 0:
            raise ValueError("expected_interval_seconds and escalation_max_age_seconds must be "
                             "positive")

    @classmethod
    def from_settings(cls, settings: OrchestratorSettings,
                      doctor: DoctorSettings | None = None,
                      webhooks: WebhooksSettings | None = None) -> DoctorLimits:
        """The ``[orchestrator]`` values (and ``[doctor]``'s and ``[webhooks]``', when given)."""
        inbox = (doctor or DoctorSettings()).inbox_age_alert
        return cls(settings.expected_interval_seconds, settings.escalation_max_age_seconds,
                   inbox, (webhooks or WebhooksSettings()).alert_after)


@dataclass
class Checkup:
    """The doctor's findings: ``ok`` when there are no problems."""

    problems: list[str] = field(default_factory=list)
    #: What a reader should know that is not wrong (``no fire has ever run``).
    notes: list[str] = field(default_factory=list)
    last_fire: dict[str, Any] | None = None
    stranded: int = 0
    oldest_escalation_age_seconds: float | None = None
    #: Questions and approvals waiting longer than ``inbox_age_alert``.
    inbox_overdue: int = 0
    #: Webhook events dead-lettered, and waiting longer than ``[webhooks] alert_after``.
    webhook_dead: int = 0
    webhook_backlog: int = 0
    #: Each active schedule: its name, next due slot and how late it is (``schedule``).
    schedules: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` shape."""
        return {"ok": self.ok, "problems": list(self.problems), "notes": list(self.notes),
                "last_fire": self.last_fire,
                "schedules": self.schedules,
                "stranded": self.stranded,
                "oldest_escalation_age_seconds": self.oldest_escalation_age_seconds,
                "inbox_overdue": self.inbox_overdue,
                "webhook_dead": self.webhook_dead, "webhook_backlog": self.webhook_backlog}

    def summary(self) -> str:
        """A short all-clear line (when ``ok``)."""
        fire = self.last_fire
        when = (f"last fire {fire['id']} {_age(fire['age_seconds'])} ago" if fire
                else "no fire has run")
        return f"all clear: {when}, nothing stranded, no escalation overdue"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def diagnose(last_fire: Mapping[str, Any] | None, stranded: Sequence[Mapping[str, Any]],
             escalations: Sequence[Mapping[str, Any]], limits: DoctorLimits,
             now: dt.datetime | None = None) -> Checkup:
    """Judge the rows the store returned; pure, so every rule is tested without waiting."""
    now = now or dt.datetime.now(dt.UTC)
    check = Checkup(stranded=len(stranded))
    expected = limits.expected_interval_seconds
    if last_fire is None:
        check.notes.append("no fire has ever run: fine with always-on workers (`orgchart "
                           "worker`); with a fleet, schedule `orgchart fire` (expected every "
                           f"{_age(expected)})")
    else:
        age = (now - last_fire["started_at"]).total_seconds()
        finished = last_fire.get("finished_at")
        check.last_fire = {"id": last_fire["id"], "started_at": last_fire["started_at"],
                           "finished_at": finished, "age_seconds": round(age, 3)}
        if age > expected:
            check.problems.append(
                f"the last fire (#{last_fire['id']}) started {_age(age)} ago; one is expected "
                f"every {_age(expected)}: is the scheduler running `orgchart fire`?")
        elif finished is None and age > expected / 2:
            check.problems.append(f"the last fire (#{last_fire['id']}) started {_age(age)} ago "
                                  "and has not finished")
    if stranded:
        why = Counter(str(r["why"]) for r in stranded)
        ids = ", ".join(str(r["id"]) for r in stranded[:3]) + (", ..." if len(stranded) > 3
                                                               else "")
        check.problems.append(
            f"{len(stranded)} task(s) stranded ("
            + "; ".join(f"{n} {w}" for w, n in why.most_common())
            + f"): {ids}; the next fire's hygiene releases them")
    ages = [(now - at).total_seconds() for at in (_escalated_at(e) for e in escalations)
            if at is not None]
    if ages:
        oldest = max(ages)
        check.oldest_escalation_age_seconds = round(oldest, 3)
        if oldest > limits.escalation_max_age_seconds:
            over = sum(1 for a in ages if a > limits.escalation_max_age_seconds)
            check.problems.append(
                f"{over} escalation(s) waiting longer than "
                f"{_age(limits.escalation_max_age_seconds)} (oldest {_age(oldest)}): "
                "see `orgchart escalations`")
    return check


def _escalated_at(row: Mapping[str, Any]) -> dt.datetime | None:
    at = row.get("escalated_at") or row.get("completed_at") or row.get("created_at")
    return at if isinstance(at, dt.datetime) else None


def check(store: Store, limits: DoctorLimits, now: dt.datetime | None = None) -> Checkup:
    """Read the last fire, the stranded work, the escalations and the inbox; diagnose them."""
    schedules = store.schedules.active()
    limits = fire_limits(limits, schedules)
    checkup = diagnose(store.fires.last(), store.reads.stranded(), store.reads.escalations(),
                       limits, now)
    diagnose_schedules(checkup, schedules)
    diagnose_inbox(checkup, store.steering.inbox_older_than(limits.inbox_age_alert_seconds), limits)
    diagnose_webhooks(checkup, store.webhooks.health(limits.webhook_alert_after_seconds), limits)
    return checkup


def diagnose_inbox(checkup: Checkup, overdue: Mapping[str, Any], limits: DoctorLimits) -> None:
    """Add a problem when questions or approvals wait longer than ``inbox_age_alert``."""
    questions, approvals = int(overdue["questions"]), int(overdue["approvals"])
    checkup.inbox_overdue = questions + approvals
    if checkup.inbox_overdue:
        checkup.problems.append(
            f"{questions} question(s) and {approvals} approval(s) waiting longer than "
            f"{_age(limits.inbox_age_alert_seconds)}: see `orgchart inbox`")


def fire_limits(limits: DoctorLimits, schedules: Sequence[Mapping[str, Any]]) -> DoctorLimits:
    """The limits with the fire's expected interval read from a fire schedule, if one is on.

    The interval is the one between its next two slots, plus the grace; the shortest
    wins when there are several.
    """
    intervals = [cadence_of(dict(s)).interval_seconds(s["db_now"]) for s in schedules
                 if s["kind"] == "fire"]
    if not intervals:
        return limits
    return replace(limits, expected_interval_seconds=min(intervals) + SCHEDULE_GRACE_SECONDS)


def diagnose_schedules(checkup: Checkup, schedules: Sequence[Mapping[str, Any]]) -> None:
    """Add a problem for each schedule whose next slot is past by more than the grace."""
    for s in schedules:
        late = (s["db_now"] - s["next_at"]).total_seconds()
        checkup.schedules.append({"name": s["name"], "kind": s["kind"],
                                  "next_at": s["next_at"], "late_seconds": max(0.0, late)})
        if late > SCHEDULE_GRACE_SECONDS:
            checkup.problems.append(
                f"schedule {s['name']!r} is late: its slot of {s['next_at']:%Y-%m-%d %H:%M:%S} "
                f"UTC ({cadence_of(dict(s)).describe()}) has not fired for {_age(late)}: is "
                "any worker, `orgchart serve` or `orgchart fire` running?")


def diagnose_webhooks(checkup: Checkup, health: Mapping[str, Any], limits: DoctorLimits) -> None:
    """Add a problem for dead-lettered webhook events and for a backlog past ``alert_after``."""
    checkup.webhook_dead, checkup.webhook_backlog = int(health["dead"]), int(health["backlog"])
    if checkup.webhook_dead:
        checkup.problems.append(
            f"{checkup.webhook_dead} webhook event(s) dead-lettered: see `orgchart webhooks "
            "deliveries --failed`, then `orgchart webhooks redeliver ID`")
    if checkup.webhook_backlog:
        checkup.problems.append(
            f"{checkup.webhook_backlog} webhook event(s) waiting longer than "
            f"{_age(limits.webhook_alert_after_seconds)} (oldest "
            f"{_age(float(health['oldest_seconds']))}): is a worker or `orgchart serve` "
            "running with the endpoint's secret variable set?")
