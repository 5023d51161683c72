"""Forks and diffs through the faces: the ``orgchart`` command and the HTTP API."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from runtime.store.store import Store
from runtime.wiring import Runtime
from tests.factories import submit
from tests.support import drain

with warnings.catch_warnings():  # starlette's notice about httpx2, at import time
    warnings.filterwarnings("ignore", message=".*httpx2")
    from fastapi.testclient import TestClient

REPO = Path(__file__).resolve().parents[2]
MODULE = ("--agents-module", "tests.fork_agents")


def orgchart(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.cli.app", *args],
                          env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def task_count(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM tasks")).scalar_one())


def test_fork_and_diff_on_the_command_line(orgchart_env: dict[str, str], store: Store) -> None:
    run = orgchart(orgchart_env, "run", "harbour report", "--agent", "fork_planner",
                   *MODULE, "--json")
    assert run.returncode == 0, run.stderr
    original = json.loads(run.stdout)
    writer = next(c for c in original["children"] if c["key"] == "w1")
    before = task_count(store)

    bad = orgchart(orgchart_env, "fork", writer["id"], "--payload", '{"topic": 1}', *MODULE)
    assert bad.returncode == 2 and "does not fit agent 'fork_writer'" in bad.stderr
    unknown = orgchart(orgchart_env, "fork", str(uuid.uuid4()))
    assert unknown.returncode == 2 and "no task" in unknown.stderr
    model = orgchart(orgchart_env, "fork", original["id"], "--model", "gpt-nothing", *MODULE)
    assert model.returncode == 2 and "unknown model" in model.stderr
    assert task_count(store) == before

    forked = orgchart(orgchart_env, "fork", writer["id"], "--payload",
                      '{"goal": "the lighthouse"}', "--note", "new angle", "--run", "--json",
                      *MODULE)
    assert forked.returncode == 0, forked.stderr
    branch = json.loads(forked.stdout)
    assert branch["status"] == "done" and branch["forked_from"] == original["id"]
    assert branch["fork"]["target"] == writer["id"] and branch["fork"]["note"] == "new angle"

    diff = orgchart(orgchart_env, "diff", original["id"], branch["id"], "--json")
    assert diff.returncode == 0, diff.stderr
    totals = json.loads(diff.stdout)["totals"]["b"]
    assert (totals["calls_paid"], totals["calls_replayed"]) == (2, 2)
    text = orgchart(orgchart_env, "diff", original["id"], branch["id"])
    assert "/w1" in text.stdout and "2 calls paid, 2 replayed" in text.stdout

    tree = orgchart(orgchart_env, "tree", branch["id"])
    assert f"branch of {original['id']}" in tree.stdout.replace("\n", "")
    show = orgchart(orgchart_env, "show", writer["id"])
    assert "version" in show.stdout and "forked from" not in show.stdout
    rerun = orgchart(orgchart_env, "fork", original["id"], "--json", *MODULE)
    assert rerun.returncode == 0 and json.loads(rerun.stdout)["status"] == "pending"


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime]) -> Runtime:
    return make_runtime(["tests.fork_agents"])


def test_fork_and_diff_over_http(runtime: Runtime, client: TestClient) -> None:
    root = submit(runtime.store, "fork_planner", {"goal": "g"})
    drain(runtime)
    writer = next(c for c in runtime.store.reads.children(root["id"])
                  if c["idempotency_key"] == "w0")
    before = task_count(runtime.store)

    # The payload fits no schema of the task's agent: a conflict with the task (409), as
    # the document cannot know which agent the task has.
    bad: Any = client.post(f"/tasks/{writer['id']}/fork", json={"payload": {"x": 1}})
    assert bad.status_code == 409 and "does not fit" in bad.json()["error"]
    assert client.post(f"/tasks/{uuid.uuid4()}/fork", json={}).status_code == 404
    assert client.post(f"/tasks/{root['id']}/fork", json={"agent": "nope"}).status_code == 422
    assert client.post(f"/tasks/{root['id']}/fork", json={"extra": 1}).status_code == 422
    assert task_count(runtime.store) == before

    made = client.post(f"/tasks/{writer['id']}/fork", json={"payload": {"goal": "other"}})
    assert made.status_code == 201, made.text
    branch = made.json()
    assert branch["forked_from"] == str(root["id"]) and branch["created"] is True
    drain(runtime)

    forks = client.get(f"/tasks/{root['id']}/forks").json()
    assert [f["id"] for f in forks] == [branch["id"]]
    diff = client.get(f"/diff/{root['id']}/{branch['id']}").json()
    assert diff["totals"]["b"]["calls_replayed"] == 2
    page = client.get(f"/ui/diff/{root['id']}/{branch['id']}")
    assert page.status_code == 200 and "diff.js" in page.text
    assert client.get("/ui/static/diff.js").status_code == 200
    tree = client.get(f"/trees/{branch['id']}").json()
    assert tree["forked_from"] == str(root["id"])
