"""The CLI's help as a new user reads it (issue 45, items 7 and 11).

Square brackets name configuration sections (``[worker]``, ``[tenants.<name>]``) and stay
on screen; a flag shows no ``<bool>``; ``worker`` has ``--maintenance/--no-maintenance``
(not ``--no-no-maintenance``); ``orgchart --version`` prints the installed version.
"""

from __future__ import annotations

from importlib import metadata

from typer.testing import CliRunner

from runtime.cli.app import app

runner = CliRunner()


def help_of(*command: str) -> str:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_brackets_in_help_stay_on_screen() -> None:
    assert "(default [worker] sync_threads)" in help_of("worker")
    assert "([tenants.<name>] shares and limits)" in help_of("submit")


def test_flags_show_no_bool_type() -> None:
    for command in ((), ("worker",), ("tree",), ("experiment", "run")):
        assert "<bool>" not in help_of(*command), command
    assert "<int>" in help_of("worker")  # options that take a value keep their type


def test_worker_maintenance_reads_as_a_pair() -> None:
    text = help_of("worker")
    assert "--maintenance --no-maintenance" in text
    assert "no-no-maintenance" not in text


def test_version_comes_from_the_package_metadata() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"orgchart {metadata.version('orgchart')}"
