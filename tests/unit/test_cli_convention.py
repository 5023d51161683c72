"""One CLI convention: one error handler (bad input 2, unreachable database 1), shared options."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
import typer
from typer.testing import CliRunner

from runtime import wiring
from runtime.cli.app import COMMANDS, app
from runtime.cli.common import handled


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def env(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for key in [k for k in os.environ if k.startswith("ORGCHART_") or k == "DATABASE_URL"]:
        monkeypatch.delenv(key)
    url = f"postgresql://someone:hunter2@127.0.0.1:{_closed_port()}/nothing"
    return {"ORGCHART_DATABASE_URL": url, "ORGCHART_LLM__BACKEND": "offline",
            "ORGCHART_CONFIG": os.devnull}


def test_every_command_goes_through_the_one_handler() -> None:
    for _group, name, command in COMMANDS:
        assert not getattr(command, "__wrapped__", None), f"{name} wraps its own handler"
    callbacks = [c.callback for c in app.registered_commands]
    assert all(getattr(cb, "__wrapped__", None) for cb in callbacks)


def test_bad_input_exits_2_with_one_line(env: dict[str, str]) -> None:
    result = CliRunner().invoke(app, ["show", "not-an-id"], env=env)
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: ") and "not-an-id" in result.stderr


def _count_schema_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the schema checks (the first statement a command sends) from here on."""
    tries = [0]
    check = wiring.ensure_schema

    def counted(*args: Any, **kwargs: Any) -> Any:
        tries[0] += 1
        return check(*args, **kwargs)

    monkeypatch.setattr(wiring, "ensure_schema", counted)
    return tries


@pytest.mark.parametrize("args", [["metrics"], ["escalations", "--json"], ["doctor"],
                                  ["inbox"], ["cancel", str(uuid.uuid4())]])
def test_an_unreachable_database_exits_1_naming_the_server(
        env: dict[str, str], args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Commands that read or steer try once: no riding out a failover (an hour here; a
    # command that waited would hang until the test's timeout) for a typo'd URL.
    tries = _count_schema_checks(monkeypatch)
    env = {**env, "ORGCHART_DATABASE__FAILOVER_TIMEOUT_SECONDS": "3600"}
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: cannot reach") and "127.0.0.1" in lines[0]
    assert "hunter2" not in result.output and "Traceback" not in result.output
    assert tries == [1]


def test_submit_rides_out_an_unreachable_database_then_exits_1(
        env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    tries = _count_schema_checks(monkeypatch)
    env = {**env, "ORGCHART_DATABASE__FAILOVER_TIMEOUT_SECONDS": "1"}
    result = CliRunner().invoke(app, ["submit", "a goal"], env=env)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: cannot reach") and "hunter2" not in result.output
    assert tries[0] > 1  # it tried again for a second, then gave up


def test_a_database_error_mid_command_is_one_line_naming_the_server(
        env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def dropped() -> None:
        engine = sa.create_engine(env["ORGCHART_DATABASE_URL"].replace(
            "postgresql://", "postgresql+psycopg://"), poolclass=sa.pool.NullPool)
        with engine.connect():  # a real driver error, as a dropped connection raises
            pass

    probe = typer.Typer()
    probe.command("a")(handled(dropped))
    probe.command("b")(handled(lambda: None))
    result = CliRunner().invoke(probe, ["a"])
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: cannot reach the database at postgresql+psycopg://someone:***@")
    assert "hunter2" not in line


def test_an_unexpected_error_is_one_line_exit_1() -> None:
    def broken() -> None:
        raise ZeroDivisionError("no")

    probe = typer.Typer()
    probe.command("a")(handled(broken))
    probe.command("b")(handled(lambda: None))
    result = CliRunner().invoke(probe, ["a"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "error: unexpected ZeroDivisionError: no (run with -v for the traceback)"]


def test_submit_and_run_share_one_option_set() -> None:
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    options = {name: {opt for p in commands[name].params for opt in p.opts}
               for name in ("submit", "run")}
    assert options["run"] - options["submit"] == {"--timeout", "--max-in-flight", "--quiet"}
    assert options["submit"] - options["run"] == set()
    assert {"--agent", "--type", "--priority", "--budget-tokens", "--budget-seconds",
            "--budget-usd", "--payload", "--success", "--kill", "--idempotency-key",
            "--agents-module", "--json"} <= options["submit"]
