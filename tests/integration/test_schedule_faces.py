"""``orgchart schedule`` and ``/schedules``: the same schedules, bad input refused (exit 2,
422) with nothing stored."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from runtime.cli.app import app
from runtime.config import Settings
from runtime.http.api import create_app
from runtime.store.store import Store
from runtime.wiring import load_registry

MODULE = "tests.support_agents"


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, ["schedule", *args])


@pytest.mark.usefixtures("orgchart_env")
def test_the_cli_adds_lists_pauses_resumes_runs_and_removes(store: Store) -> None:
    added = cli("add", "morning", "--cron", "0 7 * * *", "--timezone", "Europe/Berlin",
                "--goal", "refresh the competitor map", "--agent", "noop",
                "--agents-module", MODULE, "--json")
    assert added.exit_code == 0, added.output
    row = json.loads(added.output)
    assert row["cadence"] == "cron '0 7 * * *' (Europe/Berlin)" and row["agent"] == "noop"
    assert cli("add", "fire", "--every", "1h", "--fire").exit_code == 0
    listed = json.loads(cli("list", "--json").output)
    assert [r["name"] for r in listed] == ["fire", "morning"]
    assert json.loads(cli("pause", "morning", "--json").output)["paused"] is True
    assert json.loads(cli("resume", "morning", "--json").output)["paused"] is False
    ran = json.loads(cli("run-now", "morning", "--json").output)
    assert ran["fired"] == 1 and len(ran["roots"]) == 1
    runs = json.loads(cli("runs", "morning", "--json").output)
    assert [r["root_id"] for r in runs] == ran["roots"]
    text = cli("list")
    assert text.exit_code == 0 and "morning" in text.output and "1/0/0" in text.output
    assert ran["roots"][0] in cli("runs", "morning").output
    assert cli("remove", "morning").exit_code == 0
    assert [r["name"] for r in store.schedules.all()] == ["fire"]


@pytest.mark.usefixtures("orgchart_env")
@pytest.mark.parametrize(("args", "message"), [
    (["--cron", "0 7 * *", "--goal", "g"], "bad cron line"),
    (["--every", "5 minutes", "--goal", "g"], "bad interval"),
    (["--cron", "0 7 * * *", "--timezone", "Europe/Atlantis", "--goal", "g"],
     "unknown time zone"),
    (["--every", "5m", "--goal", "g", "--agent", "inteldirector"], "unknown agent"),
    (["--every", "5m"], "exactly one of --goal TEXT and --fire"),
    (["--every", "5m", "--goal", "g", "--catchup-window", "soon"], "--catchup-window"),
])
def test_bad_input_exits_2_with_a_message_and_stores_nothing(store: Store, args: list[str],
                                                             message: str) -> None:
    result = cli("add", "bad", *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert store.schedules.all() == []


def test_the_api_serves_the_same_schedules(store: Store) -> None:
    settings = Settings()
    client = TestClient(create_app(store=store, settings=settings,
                                   registry=load_registry(settings, [MODULE])))
    made = client.post("/schedules", json={"name": "hourly", "every": "1h", "goal": "look",
                                           "agent": "noop", "overlap": "allow"})
    assert made.status_code == 201, made.text
    assert made.json()["cadence"] == "every 1h"
    bad = client.post("/schedules", json={"name": "bad", "cron": "0 25 * * *", "goal": "x",
                                          "agent": "noop"})
    assert bad.status_code == 422 and "bad cron line" in bad.text
    unknown = client.post("/schedules", json={"name": "bad", "every": "1m", "goal": "x",
                                              "agent": "nobody"})
    assert unknown.status_code == 422
    assert [s["name"] for s in client.get("/schedules").json()] == ["hourly"]
    ran = client.post("/schedules/hourly/run-now").json()
    assert ran["fired"] == 1
    assert client.get("/schedules/hourly/runs").json()[0]["root_id"] == ran["roots"][0]
    assert client.post("/schedules/hourly/pause").json()["paused"] is True
    assert client.post("/schedules/hourly/resume").json()["paused"] is False
    assert client.post("/schedules/nope/pause").status_code == 404
    assert client.delete("/schedules/hourly").status_code == 204
    assert client.get("/schedules").json() == []


@pytest.mark.usefixtures("orgchart_env")
def test_doctor_exits_1_naming_a_late_schedule_and_reads_the_fire_interval_from_it(
        store: Store) -> None:
    assert cli("add", "fire", "--every", "1h", "--fire").exit_code == 0
    with store.database.transaction() as conn:  # the last fire: two hours ago, finished
        conn.execute(sa.text("INSERT INTO fires (started_at, finished_at) VALUES "
                             "(now() - interval '2 hours', now() - interval '2 hours')"))
        conn.execute(sa.text("UPDATE schedules SET next_at = now() - interval '10 minutes'"))
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    fire, late = [p for p in report["problems"] if "fire" in p][:2]
    assert "one is expected every 61m" in fire  # the schedule's hour plus a minute
    assert "schedule 'fire' is late" in late
    assert report["schedules"][0]["late_seconds"] >= 600
