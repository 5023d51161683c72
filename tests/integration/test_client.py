"""`import orgchart`: the client over the database and over HTTP, and what `run` runs.

- `orgchart run` and `Client.run` claim only their own tree: a goal submitted earlier and
  still queued stays pending, with no model call (issue 45, item 2);
- `orgchart run` prints the root's answer (item 3);
- `submit` warns when no live worker would run the goal, in the CLI, the API and the MCP
  tool; `orgchart mcp --worker` runs one in its own process (item 9);
- docs/client.md's first example runs as written, as a user runs it.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

import orgchart
from runtime.http.api import create_app
from runtime.store.postgres import urls
from runtime.store.rows import NewTask
from runtime.store.store import Store
from runtime.wiring import Runtime
from tests.integration.test_docs_agents import code_blocks
from tests.support import drain

REPO = Path(__file__).resolve().parents[2]
GOAL = "Assess the market for durable agent runtimes"
NO_WORKER = "no live worker serves agent"
FENCE = re.compile(r'^```python title="(?P<title>[^"]+)"\n(?P<code>.*?)^```$', re.M | re.S)


def orgchart_cli(env: dict[str, str], *args: str, cwd: Path = REPO
                 ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.cli.app", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=180)


def untouched(db_url: str, root: str) -> tuple[str, int, int]:
    """A root's status, its events and the model calls made in its tree."""
    with psycopg.connect(urls.libpq_url(db_url)) as conn:
        status = conn.execute("SELECT status FROM tasks WHERE id = %s", (root,)).fetchone()
        events = conn.execute("SELECT count(*) FROM task_events e JOIN tasks t ON t.id = "
                              "e.task_id WHERE t.root_id = %s", (root,)).fetchone()
        calls = conn.execute("SELECT count(*) FROM model_calls WHERE root_id = %s",
                             (root,)).fetchone()
    assert status and events and calls
    return status[0], events[0], calls[0]


# ---------------------------------------------------------------- the CLI
def test_run_leaves_an_earlier_goal_queued_and_prints_the_answer(
        orgchart_env: dict[str, str], db_url: str) -> None:
    earlier = orgchart_cli(orgchart_env, "submit", "someone else's goal")
    assert earlier.returncode == 0, earlier.stderr
    assert f"warning: {NO_WORKER} 'ceo'" in " ".join(earlier.stderr.split())
    other = earlier.stdout.strip()

    ran = orgchart_cli(orgchart_env, "run", GOAL)
    assert ran.returncode == 0, ran.stderr
    answer = ran.stdout.split("\nanswer\n", 1)[1]
    assert answer.startswith("summary: offline: ") and "\nfindings:\n  - offline: " in answer
    # Before issue 45 the run's worker claimed the queue: this tree ran (and paid) too.
    assert untouched(db_url, other) == ("pending", 1, 0)


# ---------------------------------------------------------------- over the database
def test_the_client_runs_its_own_tree_and_steers_another(
        orgchart_env: dict[str, str], db_url: str) -> None:
    with orgchart.Client(db_url) as client:
        other = client.submit("someone else's goal", budget_usd="0.50")
        assert other.status == "pending" and other.created
        assert other.warning is not None and NO_WORKER in other.warning
        run = client.run(GOAL, timeout=120)
        assert run.status == "done" and run.finished
        assert run.result["summary"].startswith("offline: ")
        tree = run.tree()
        assert run.cost_usd == Decimal(tree["spent_usd"]) > 0
        assert run.spent_tokens == tree["totals"]["spent_tokens"]
        assert run.served_by == {"offline": 9}  # the seed tree's calls, offline
        assert client.get(str(run.id)).status == "done"

        assert untouched(db_url, str(other.id)) == ("pending", 1, 0)
        assert other.pause("hold")["changed"] is True
        assert other.resume()["changed"] is True
        assert other.cancel("not today")["status"] == "cancelled"
        assert other.refresh().status == "cancelled" and other.finished

        with pytest.raises(orgchart.BadInput, match="nobody"):
            client.submit("x", agent="nobody")
        client.submit("keyed", idempotency_key="k-db")
        with pytest.raises(orgchart.IdempotencyConflict):
            client.submit("keyed differently", idempotency_key="k-db")
        with pytest.raises(orgchart.NotFound):
            client.get(uuid.uuid4())
        with pytest.raises(TimeoutError, match="still"):
            client.submit("waits for nobody").wait(timeout=0.05)


def test_the_async_client_answers_a_question_while_its_run_waits(
        orgchart_env: dict[str, str], db_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ask_a_person.py").write_text(code_blocks("ask_a_person.py"), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))

    async def main() -> orgchart.AsyncRun:
        async with orgchart.AsyncClient(db_url) as client:
            running = asyncio.create_task(client.run(
                "the winter report", "publisher", agents_module=["ask_a_person"],
                timeout=120))
            question = None
            while question is None:
                assert not running.done(), running
                items = await client.inbox()
                question = next((i for i in items if i["kind"] == "question"), None)
                await asyncio.sleep(0.02)
            with pytest.raises(orgchart.SteeringRefused, match="choices"):
                await client.answer(question["id"], "maybe")
            answered = await client.answer(question["id"], "yes", by="alice")
            assert answered["status"] == "done"
            return await running

    run = asyncio.run(main())
    assert (run.status, run.result) == ("done", {"text": "publish: yes"})


# ---------------------------------------------------------------- over HTTP
def test_the_client_over_http_submits_waits_and_steers(runtime: Runtime,
                                                      client: TestClient) -> None:
    http = orgchart.Client.http("http://testserver", http_client=client)
    run = http.submit("over http", agent="echo", idempotency_key="k-http")
    assert run.status == "pending" and run.warning and NO_WORKER in run.warning
    assert http.submit("over http", agent="echo", idempotency_key="k-http").created is False
    with pytest.raises(orgchart.IdempotencyConflict, match=str(run.id)):
        http.submit("another goal", agent="echo", idempotency_key="k-http")
    drain(runtime)
    assert run.wait(timeout=30).status == "done"
    assert run.result["echo"] == "over http" and run.cost_usd == 0
    assert run.tree()["totals"]["tasks"] == 1

    other = http.submit("steer me", agent="echo")
    assert other.pause()["changed"] is True and other.resume()["changed"] is True
    assert other.cancel("no")["status"] == "cancelled"
    assert http.inbox() == []
    with pytest.raises(orgchart.BadInput):
        http.submit("x", agent="nobody")
    with pytest.raises(orgchart.NotFound):
        http.get(uuid.uuid4())
    with pytest.raises(orgchart.SteeringRefused):
        http.answer(other.id, "yes")


def test_the_http_client_sends_its_token(runtime: Runtime,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(store=runtime.store, settings=runtime.settings,
                     registry=runtime.registry, api_token="s3cret")
    with TestClient(app) as raw:
        with pytest.raises(orgchart.RequestFailed) as refused:
            orgchart.Client.http("http://testserver", http_client=raw).submit("x", "echo")
        assert refused.value.status_code == 401
    with TestClient(app) as raw:
        run = orgchart.Client.http("http://testserver", "s3cret", http_client=raw).submit(
            "with a token", "echo")
        assert run.status == "pending"


# ---------------------------------------------------------------- the claim
def test_a_tree_claim_takes_only_the_named_trees(store: Store) -> None:
    mine, _ = store.tasks.submit(NewTask(to_agent="echo", type="task", payload={"goal": "mine"}))
    theirs, _ = store.tasks.submit(NewTask(to_agent="echo", type="task", payload={"goal": "x"},
                                           priority=0))
    rows = store.claims.claim_in_trees([mine["id"]], ["echo"], 10, "w-tree", 30)
    assert [r.id for r in rows] == [mine["id"]]
    assert store.claims.claim_in_trees([mine["id"]], ["echo"], 10, "w-tree", 30) == []
    assert store.reads.get(theirs["id"])["status"] == "pending"

    # The judge stage's lease, likewise: results of other trees wait for other judges.
    judged = [store.tasks.submit(NewTask(to_agent="echo", type="task",
                                         payload={"goal": g}))[0]["id"]
              for g in ("mine", "theirs")]
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE tasks SET status = 'judging' WHERE id = ANY(:ids)"),
                     {"ids": judged})
    leased = store.claims.claim_in_trees([judged[0]], (), 10, "w-tree", 30, judging=True)
    assert [(r.id, r.status) for r in leased] == [(judged[0], "judging")]
    assert store.claims.claim_judging(10, "w-other", 30)[0].id == judged[1]


# ---------------------------------------------------------------- MCP
def test_mcp_submit_warns_without_a_worker_and_runs_with_one(
        orgchart_env: dict[str, str]) -> None:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    def params(*extra: str) -> StdioServerParameters:
        return StdioServerParameters(
            command=sys.executable, args=["-m", "runtime.cli", "mcp", *extra],
            env={**orgchart_env, "PYTHONPATH": str(REPO)}, cwd=str(REPO))

    async def submit(arguments: dict[str, Any], *extra: str) -> dict[str, Any]:
        async with stdio_client(params(*extra)) as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            result = await session.call_tool("submit_goal", arguments)
            assert not result.is_error, result.content
            return dict(json.loads(result.content[0].text))  # type: ignore[union-attr]

    alone = asyncio.run(submit({"prompt": "nobody runs this"}))
    assert alone["status"] == "pending" and NO_WORKER in alone["warning"]
    served = asyncio.run(submit({"prompt": GOAL, "wait": True, "timeout_seconds": 120},
                                "--worker"))
    assert served["ended"] is True and served["status"] == "done"


# ---------------------------------------------------------------- the docs
def test_the_docs_example_runs_as_written(orgchart_env: dict[str, str],
                                          tmp_path: Path) -> None:
    text = (REPO / "docs" / "client.md").read_text(encoding="utf-8")
    (example,) = [m["code"] for m in FENCE.finditer(text) if m["title"] == "client_example.py"]
    (tmp_path / "client_example.py").write_text(example, encoding="utf-8")
    env = {k: v for k, v in orgchart_env.items() if k != "PYTHONPATH"}
    ran = subprocess.run([sys.executable, "client_example.py"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == "done" and lines[1].startswith("offline: ")
    assert lines[2].startswith("$0.") and "{'offline': 9}" in lines[2]
    assert lines[3] == "5"
