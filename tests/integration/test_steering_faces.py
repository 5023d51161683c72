"""Steering on the CLI and the HTTP API, and docs/writing-agents.md's "Ask a person" example.

The example module is taken from the doc exactly as written, imported once, and run by a
real worker (in this process, offline backend) against a private database.
"""

from __future__ import annotations

import importlib
import json
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from runtime.cli.app import app
from runtime.store.rows import NewTask
from runtime.wiring import Runtime
from tests.factories import parent_with_children, submit
from tests.integration.test_docs_agents import code_blocks
from tests.support import drain

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2")
    from fastapi.testclient import TestClient

runner = CliRunner()


@pytest.fixture(scope="module")
def example_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """docs/writing-agents.md's ask_a_person.py, importable (once per module)."""
    where = tmp_path_factory.mktemp("docs")
    (where / "ask_a_person.py").write_text(code_blocks("ask_a_person.py"), encoding="utf-8")
    sys.path.insert(0, str(where))
    importlib.import_module("ask_a_person")
    yield "ask_a_person"
    sys.path.remove(str(where))


@pytest.fixture
def runtime(orgchart_env: dict[str, str], make_runtime: Callable[..., Runtime],
            example_module: str) -> Runtime:
    return make_runtime(["tests.support_agents", example_module])


def cli(*args: str) -> Any:
    return runner.invoke(app, list(args))


def cli_json(*args: str) -> Any:
    result = cli(*args, "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def _publisher(runtime: Runtime) -> tuple[uuid.UUID, uuid.UUID]:
    root, _ = runtime.store.tasks.submit(NewTask("publisher", "publish", {"goal": "the report"}))
    drain(runtime)
    (question,) = runtime.store.reads.children(root["id"])
    return root["id"], question["id"]


# ---------------------------------------------------------------- the doc's example
def test_the_docs_example_asks_a_person_and_uses_the_answer(runtime: Runtime) -> None:
    root, q = _publisher(runtime)
    assert runtime.store.reads.get(q)["status"] == "pending"   # no worker took the question
    inbox = cli_json("inbox")
    assert [(i["kind"], i["id"], i["asking_agent"], i["choices"]) for i in inbox] == [
        ("question", str(q), "publisher", ["yes", "no"])]
    bad = cli("answer", str(q), "--json", '"maybe"')
    assert bad.exit_code == 2 and "not one of the choices" in bad.stderr
    assert runtime.store.reads.get(q)["status"] == "pending"
    good = cli("answer", str(q), "--json", '"yes"', "--by", "alice")
    assert good.exit_code == 0, good.stderr
    assert runtime.store.reads.get(root)["status"] == "ready_to_aggregate"
    drain(runtime)
    done = runtime.store.reads.get(root)
    assert done["status"] == "done" and done["result"] == {"text": "publish: yes"}
    assert runtime.store.reads.events(q)[-1]["worker"] == "alice"


def test_an_unanswered_question_lets_the_parent_decide(runtime: Runtime) -> None:
    root, q = _publisher(runtime)
    with runtime.store.database.transaction() as conn:
        import sqlalchemy as sa

        conn.execute(sa.text("UPDATE tasks SET created_at = now() - interval '2 hours' "
                             "WHERE id = :id"), {"id": q})
    runtime.store.steering.fail_unanswered()
    drain(runtime)
    assert runtime.store.reads.get(root)["result"] == {"text": "not published: no answer: deadline"}


# ---------------------------------------------------------------- CLI
def test_cli_cancel_pause_resume(runtime: Runtime) -> None:
    root, _ = parent_with_children(runtime.store, 2)
    paused = cli_json("pause", str(root["id"]), "--note", "look first")
    assert paused["changed"] is True
    tree = cli_json("tree", str(root["id"]))
    assert tree["paused"] is True
    assert "paused" in cli("tree", str(root["id"])).stdout
    assert cli_json("resume", str(root["id"]))["changed"] is True
    out = cli_json("cancel", str(root["id"]), "--note", "wrong goal", "--by", "erin")
    assert out["cancelled"] == 3
    again = cli("cancel", str(root["id"]))
    assert again.exit_code == 0 and "already cancelled" in again.stdout
    missing = cli("cancel", str(uuid.uuid4()))
    assert missing.exit_code == 2 and "no task" in missing.stderr
    assert cli("pause", "not-an-id").exit_code == 2


def test_a_root_posted_to_an_approval_agent_is_held_until_approved(
        runtime: Runtime, client: TestClient) -> None:
    runtime.store.policies.approval_agents = ("echo",)
    posted = client.post("/tasks", json={"prompt": "needs a yes", "agent": "echo"})
    assert posted.status_code == 201, posted.text
    task = posted.json()
    assert task["status"] == "awaiting_approval"
    assert [i["id"] for i in client.get("/inbox").json()] == [task["id"]]
    assert client.post(f"/tasks/{task['id']}/approve", json={"by": "dan"}).status_code == 200
    assert runtime.store.reads.get(uuid.UUID(task["id"]))["status"] == "pending"


def test_cli_approve_and_reject(runtime: Runtime) -> None:
    runtime.store.policies.approval_agents = ("echo",)
    _, kids = parent_with_children(runtime.store, 2)
    inbox = cli_json("inbox")
    assert sorted(i["kind"] for i in inbox) == ["approval", "approval"]
    assert cli_json("approve", str(kids[0]["id"]), "--note", "ok")["changed"] is True
    second = cli("approve", str(kids[0]["id"]))
    assert second.exit_code == 0 and "nothing to approve" in second.stdout
    assert cli("reject", str(kids[1]["id"])).exit_code == 2     # a note is required
    assert cli_json("reject", str(kids[1]["id"]), "--note", "too dear")["status"] == "failed"


def test_doctor_reports_an_old_question(runtime: Runtime) -> None:
    _, q = _publisher(runtime)
    with runtime.store.database.transaction() as conn:
        import sqlalchemy as sa

        conn.execute(sa.text("UPDATE tasks SET created_at = now() - interval '2 hours', "
                             "budget_seconds = 86400 WHERE id = :id"), {"id": q})
    result = cli("doctor", "--json")
    body = json.loads(result.stdout)
    assert body["inbox_overdue"] == 1
    assert any("question(s)" in p for p in body["problems"])


# ---------------------------------------------------------------- HTTP
def test_api_steering(client: TestClient, runtime: Runtime) -> None:
    root, kids = parent_with_children(runtime.store, 2)
    rid = root["id"]
    r = client.post(f"/trees/{rid}/pause", json={"note": "hold", "by": "api-user"})
    assert r.status_code == 200 and r.json()["changed"] is True
    assert client.get(f"/trees/{rid}/pause").json()["paused"] is True
    assert client.post(f"/trees/{kids[0]['id']}/pause").status_code == 422
    assert client.post(f"/trees/{rid}/resume").json()["changed"] is True
    assert client.post(f"/tasks/{uuid.uuid4()}/cancel").status_code == 404
    r = client.post(f"/tasks/{kids[0]['id']}/cancel", json={"note": "not needed"})
    assert r.status_code == 200 and r.json()["cancelled"] == 1
    assert client.post(f"/tasks/{kids[0]['id']}/cancel").json()["changed"] is False


def test_api_answer_and_inbox(client: TestClient, runtime: Runtime) -> None:
    root, q = _publisher(runtime)
    inbox = client.get("/inbox").json()
    assert [i["id"] for i in inbox] == [str(q)]
    bad = client.post(f"/tasks/{q}/answer", json={"answer": "perhaps"})
    assert bad.status_code == 422 and "choices" in bad.json()["error"]
    assert runtime.store.reads.get(q)["status"] == "pending"
    ok = client.post(f"/tasks/{q}/answer", json={"answer": "no", "by": "frank"})
    assert ok.status_code == 200 and ok.json()["parents_ready"] == [str(root)]
    assert client.get("/inbox").json() == []


def test_api_approve_reject(client: TestClient, runtime: Runtime) -> None:
    runtime.store.policies.approval_agents = ("echo",)
    _, kids = parent_with_children(runtime.store, 2)
    assert client.post(f"/tasks/{kids[0]['id']}/approve").json()["changed"] is True
    assert client.post(f"/tasks/{kids[0]['id']}/approve").json()["changed"] is False
    assert client.post(f"/tasks/{kids[1]['id']}/reject", json={}).status_code == 422
    r = client.post(f"/tasks/{kids[1]['id']}/reject", json={"note": "no"})
    assert r.json()["status"] == "failed"
    assert submit(runtime.store)  # the store still takes work
