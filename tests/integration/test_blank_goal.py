"""A blank goal is refused before anything is written (issue 45, item 8).

``"   "`` used to be accepted and run a whole tree to ``done`` on nothing: the CLI exits 2
saying the goal is blank, the HTTP API answers 422, and no task row is written.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from runtime.cli.app import app
from runtime.wiring import Runtime

BLANKS = ["   ", "\t\n", ""]


def task_count(runtime: Runtime) -> int:
    with runtime.store.engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM tasks")).scalar_one())


@pytest.mark.parametrize("command", ["submit", "run"])
@pytest.mark.parametrize("goal", BLANKS)
def test_the_cli_refuses_a_blank_goal(orgchart_env: dict[str, str], runtime: Runtime,
                                      command: str, goal: str) -> None:
    result = CliRunner().invoke(app, [command, goal])
    assert result.exit_code == 2, result.output
    assert "the goal is blank" in result.stderr
    assert task_count(runtime) == 0


@pytest.mark.parametrize("goal", BLANKS)
def test_the_api_refuses_a_blank_goal(client: Any, runtime: Runtime, goal: str) -> None:
    answer = client.post("/tasks", json={"prompt": goal})
    assert answer.status_code == 422, answer.text
    assert "blank" in answer.text or "at least 1 character" in answer.text
    assert task_count(runtime) == 0
