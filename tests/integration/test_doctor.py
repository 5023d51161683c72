"""``orgchart doctor``: red when the fire is overdue, work is stranded or an escalation is old.

The rules are tested on :func:`runtime.fleet.doctor.diagnose` with a fixed clock; the command
against a real database, before and right after a real fire.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from typer.testing import CliRunner

from runtime.cli.app import app
from runtime.fleet.doctor import DoctorLimits, diagnose
from runtime.store.rows import RunOutcome
from runtime.store.store import Store
from tests.factories import expire_leases, submit

MODULE = "tests.support_agents"
REPO_ROOT = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
LIMITS = DoctorLimits(expected_interval_seconds=8 * 3600, escalation_max_age_seconds=24 * 3600)


def fire_row(hours_ago: float, finished: bool = True) -> dict[str, Any]:
    started = NOW - dt.timedelta(hours=hours_ago)
    return {"id": 7, "started_at": started,
            "finished_at": started + dt.timedelta(seconds=30) if finished else None}


def escalation(hours_ago: float) -> dict[str, Any]:
    return {"id": uuid.uuid4(), "escalated_at": NOW - dt.timedelta(hours=hours_ago)}


# ---------------------------------------------------------------------- the rules
def test_never_having_fired_is_a_note_not_a_problem() -> None:
    # Always-on workers are a supported way to run: a fresh setup must not be red.
    check = diagnose(None, [], [], LIMITS, NOW)
    assert check.ok and check.problems == []
    assert check.notes == ["no fire has ever run: fine with always-on workers (`orgchart "
                           "worker`); with a fleet, schedule `orgchart fire` (expected every "
                           "8.0h)"]
    assert check.as_dict()["last_fire"] is None and check.as_dict()["notes"] == check.notes
    assert check.summary().startswith("all clear: no fire has run")


def test_without_any_fire_stranded_work_is_still_a_problem() -> None:
    check = diagnose(None, [{"id": "t", "why": "lease expired"}], [], LIMITS, NOW)
    assert not check.ok and check.problems[0].startswith("1 task(s) stranded")


def test_an_overdue_fire_is_a_problem_and_a_recent_one_is_not() -> None:
    late = diagnose(fire_row(9), [], [], LIMITS, NOW)
    assert late.problems == ["the last fire (#7) started 9.0h ago; one is expected every "
                             "8.0h: is the scheduler running `orgchart fire`?"]
    fresh = diagnose(fire_row(1), [], [], LIMITS, NOW)
    assert fresh.ok and fresh.problems == []
    assert fresh.last_fire is not None and fresh.last_fire["age_seconds"] == 3600
    assert fresh.summary().startswith("all clear: last fire 7 60m ago")


def test_a_fire_that_started_long_ago_and_never_finished_is_a_problem() -> None:
    check = diagnose(fire_row(5, finished=False), [], [], LIMITS, NOW)
    assert check.problems == ["the last fire (#7) started 5.0h ago and has not finished"]
    assert diagnose(fire_row(0.01, finished=False), [], [], LIMITS, NOW).ok  # still running


def test_stranded_work_is_a_problem_with_the_reasons_counted() -> None:
    rows = [{"id": f"t{i}", "why": "lease expired"} for i in range(4)] + [
        {"id": "p1", "why": "waiting parent with all children terminal"}]
    check = diagnose(fire_row(1), rows, [], LIMITS, NOW)
    assert check.stranded == 5
    assert check.problems == [
        "5 task(s) stranded (4 lease expired; 1 waiting parent with all children terminal): "
        "t0, t1, t2, ...; the next fire's hygiene releases them"]


def test_an_escalation_older_than_the_limit_is_a_problem() -> None:
    check = diagnose(fire_row(1), [], [escalation(30), escalation(2)], LIMITS, NOW)
    assert check.oldest_escalation_age_seconds == 30 * 3600
    assert check.problems == ["1 escalation(s) waiting longer than 24.0h (oldest 30.0h): see "
                              "`orgchart escalations`"]
    young = diagnose(fire_row(1), [], [escalation(2)], LIMITS, NOW)
    assert young.ok and young.oldest_escalation_age_seconds == 2 * 3600


def test_every_problem_is_reported_at_once() -> None:
    check = diagnose(fire_row(9), [{"id": "t", "why": "lease expired"}], [escalation(48)],
                     LIMITS, NOW)
    assert len(check.problems) == 3
    assert set(check.as_dict()) == {"ok", "problems", "notes", "last_fire", "stranded",
                                    "oldest_escalation_age_seconds", "inbox_overdue",
                                    "schedules", "webhook_dead", "webhook_backlog"}


# ---------------------------------------------------------------------- the command
def doctor(*args: str) -> Any:
    return CliRunner().invoke(app, ["doctor", *args])


def test_doctor_flags_an_overdue_fire_and_stranded_work_and_is_green_after_a_fire(
        store: Store, orgchart_env: dict[str, str]) -> None:
    first = doctor()  # a fresh setup: no fire yet is information, not a failure
    assert first.exit_code == 0, first.output
    assert first.output.startswith("note: no fire has ever run")
    assert "all clear" in first.output

    with store.database.transaction() as conn:
        conn.execute(sa.text("INSERT INTO fires (started_at, finished_at) "
                             "VALUES (now() - interval '9 hours', now() - interval '9 hours')"))
    task = submit(store, "echo", {"goal": "left by a dead worker"})
    store.claims.claim(["echo"], 1, "dead-host:1:x", 30)
    expire_leases(store, minutes=10)
    red = doctor("--json")
    assert red.exit_code == 1
    report = json.loads(red.output)
    assert report["ok"] is False and report["stranded"] == 1
    assert report["last_fire"]["age_seconds"] > 8 * 3600
    assert [p.split(" ")[:3] for p in report["problems"]] == [
        ["the", "last", "fire"], ["1", "task(s)", "stranded"]]
    text = doctor()
    assert text.exit_code == 1
    assert [line.split(":")[0] for line in text.output.splitlines()] == ["problem", "problem"]

    env = dict(orgchart_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    fired = subprocess.run([sys.executable, "-m", "runtime.cli.app", "fire", "--agents-module",
                            MODULE], env=env, capture_output=True, text=True, timeout=90,
                           cwd=REPO_ROOT)
    assert fired.returncode == 0, fired.stderr
    assert store.reads.get(task["id"])["status"] == "done"
    green = doctor()
    assert green.exit_code == 0, green.output
    assert green.output.startswith("all clear: last fire")
    assert json.loads(doctor("--json").output)["ok"] is True


def test_doctor_flags_an_escalation_waiting_too_long(
        store: Store, orgchart_env: dict[str, str]) -> None:
    with store.database.transaction() as conn:
        conn.execute(sa.text("INSERT INTO fires (started_at, finished_at) VALUES (now(), now())"))
    task = submit(store, "echo")
    (row,) = store.claims.claim(["echo"], 1, "w:1:x", 30)
    store.transitions.finish_running([RunOutcome(task["id"], row["lease_token"], "escalated",
                                                 error="needs a decision")], "w:1:x")
    assert doctor().exit_code == 0
    with store.database.transaction() as conn:
        conn.execute(sa.text("UPDATE task_events SET at = at - interval '2 days' "
                             "WHERE to_status = 'escalated'"))
    late = doctor("--json")
    assert late.exit_code == 1
    report = json.loads(late.output)
    assert report["oldest_escalation_age_seconds"] > 2 * 86400 - 60
    assert report["problems"][0].startswith("1 escalation(s) waiting longer than 24.0h")
