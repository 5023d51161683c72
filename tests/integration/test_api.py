"""The HTTP API on the real test database, through FastAPI's TestClient."""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from runtime.config import load_settings
from runtime.http.api import create_app
from runtime.store.postgres.engines import create_db_engine
from runtime.store.reads import Reads
from runtime.store.store import Store
from runtime.views import TASK_FIELDS, tree_json
from runtime.wiring import Runtime, build_runtime
from tests.conftest import drop_database, make_database

with warnings.catch_warnings():  # starlette's notice about httpx2, at import time
    warnings.filterwarnings("ignore", message=".*httpx2")
    from fastapi.testclient import TestClient


@pytest.fixture
def runtime(db_url: str, store: Store) -> Runtime:
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "offline",
                                  "ORGCHART_RETRY__MAX_RETRY": "0"})
    return build_runtime(settings, ["tests.support_agents"], store=store)


def make_client(runtime: Runtime, **kw: Any) -> TestClient:
    return TestClient(create_app(store=runtime.store, settings=runtime.settings,
                                 registry=runtime.registry, **kw))


@pytest.fixture
def client(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.delenv("ORGCHART_API_TOKEN", raising=False)
    with make_client(runtime) as c:
        yield c


@pytest.fixture(scope="module")
def shared(server_url: str, template_db: str) -> Iterator[tuple[TestClient, Store]]:
    """One database for the tests that must not write anything (bad input)."""
    url = make_database(server_url, template_db)
    store = Store(create_db_engine(url, pool_size=2))
    settings = load_settings(env={"ORGCHART_DATABASE_URL": url,
                                  "ORGCHART_LLM__BACKEND": "offline"})
    rt = build_runtime(settings, ["tests.support_agents"], store=store)
    with make_client(rt, api_token="") as c:
        yield c, store
    store.dispose()
    drop_database(server_url, url)


def drain(runtime: Runtime) -> None:
    worker = runtime.worker(None, maintenance=False, listen=False)
    for _ in range(50):
        if worker.run_once() == 0 and runtime.store.hygiene.sweep().ready == 0:
            return


def submit(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/tasks", json={"prompt": "hello", "agent": "echo", **body})
    assert response.status_code == 201, response.text
    return response.json()


def count_roots(store: Store) -> int:
    return len(store.reads.recent_roots(1000))


def as_json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# ---------------------------------------------------------------------- submit
def test_post_tasks_creates_a_root_and_answers_201_with_the_task(client: TestClient,
                                                                  store: Store) -> None:
    response = client.post("/tasks", json={
        "prompt": "count the stars", "agent": "echo", "priority": 3, "budget_tokens": 1000,
        "budget_usd": "0.5", "payload": {"extra": [1, 2]},
        "success_criteria": {"checks": [{"path": "$.echo", "op": "exists"}]}})
    assert response.status_code == 201, response.text
    task = response.json()
    assert set(TASK_FIELDS) <= set(task)
    assert task["status"] == "pending" and task["agent"] == "echo" and task["priority"] == 3
    assert task["payload"] == {"goal": "count the stars", "extra": [1, 2]}
    assert task["root_id"] == task["id"] and task["parent_id"] is None
    assert task["created"] is True
    assert response.headers["location"] == f"/tasks/{task['id']}"
    assert store.reads.get(uuid.UUID(task["id"]))["budget_tokens"] == 1000


def test_post_tasks_takes_a_tenant_and_refuses_a_bad_one(client: TestClient,
                                                         store: Store) -> None:
    task = submit(client, tenant="acme")
    assert task["tenant"] == "acme" and store.reads.get(uuid.UUID(task["id"]))["tenant"] == "acme"
    assert submit(client)["tenant"] == "default"
    before = count_roots(store)
    bad = client.post("/tasks", json={"prompt": "x", "agent": "echo", "tenant": "a b"})
    assert bad.status_code == 422 and "tenant" in bad.text, bad.text
    assert count_roots(store) == before


def test_the_same_idempotency_key_and_body_returns_the_same_task_once(
        client: TestClient, store: Store) -> None:
    body = {"prompt": "once", "agent": "echo"}
    first = client.post("/tasks", json=body, headers={"Idempotency-Key": "k-1"})
    second = client.post("/tasks", json=body, headers={"Idempotency-Key": "k-1"})
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]
    assert second.json()["created"] is False
    assert count_roots(store) == 1


def test_the_same_idempotency_key_with_another_body_is_a_409(client: TestClient,
                                                             store: Store) -> None:
    client.post("/tasks", json={"prompt": "a", "agent": "echo"}, headers={"Idempotency-Key": "k"})
    response = client.post("/tasks", json={"prompt": "b", "agent": "echo"},
                           headers={"Idempotency-Key": "k"})
    assert response.status_code == 409
    assert "idempotency key 'k'" in response.json()["error"]
    assert count_roots(store) == 1


@pytest.mark.parametrize(("body", "message"), [
    ({}, "missing field 'prompt'"),
    ({"prompt": "x", "colour": "red"}, "unknown field 'colour'"),
    ({"prompt": "x", "agent": "ech"}, "did you mean 'echo'"),
    ({"prompt": ""}, "body.prompt"),
    ({"prompt": 3}, "body.prompt"),
    ({"prompt": "x", "agent": "echo", "budget_tokens": -1}, "body.budget_tokens: Input should "
                                                            "be greater than or equal to 0"),
    ({"prompt": "x", "agent": "echo", "budget_usd": "lots"}, "body.budget_usd"),
    ({"prompt": "x", "agent": "echo", "priority": 10**9}, "body.priority: Input should be "
                                                          "less than or equal to 1000"),
    ({"prompt": "x", "agent": "echo", "payload": [1]}, "body.payload"),
    ({"prompt": "x", "agent": "echo", "type": "nope"}, "handles types"),
    ({"prompt": "x", "agent": "echo", "success_criteria": {"bogus": 1}}, "bogus"),
    ({"prompt": "nul \x00 here", "agent": "echo"}, "NUL character"),
    ({"prompt": "x", "agent": "echo", "payload": {"big": "y" * 300_000}}, "max_payload_bytes"),
])
def test_bad_bodies_are_422_with_a_message_naming_the_problem_and_write_nothing(
        shared: tuple[TestClient, Store], body: dict[str, Any], message: str) -> None:
    client, store = shared
    response = client.post("/tasks", json=body)
    assert response.status_code == 422, response.text
    assert message in response.json()["error"]
    assert count_roots(store) == 0


@pytest.mark.parametrize(("content", "headers", "message"), [
    (b"{not json", {"content-type": "application/json"}, "not valid JSON"),
    (b'{"prompt": "x"}', {}, "Content-Type: application/json"),
    (b'{"prompt": "x", "agent": "echo", "payload": {"n": NaN}}',
     {"content-type": "application/json"}, "JSON cannot carry"),
])
def test_malformed_json_is_a_422(shared: tuple[TestClient, Store], content: bytes,
                                 headers: dict[str, str], message: str) -> None:
    client, store = shared
    response = client.post("/tasks", content=content, headers=headers)
    assert response.status_code == 422
    assert message in response.json()["error"]
    assert count_roots(store) == 0


def test_a_body_over_the_limit_is_a_413_even_without_content_length(
        runtime: Runtime, store: Store) -> None:
    with make_client(runtime, max_body_bytes=1000) as c:
        big = json.dumps({"prompt": "x" * 2000, "agent": "echo"}).encode()
        assert c.post("/tasks", content=big,
                      headers={"content-type": "application/json"}).status_code == 413
        chunked = c.post("/tasks", content=iter([big[:600], big[600:]]),
                         headers={"content-type": "application/json"})
        assert chunked.status_code == 413
        assert "larger than 1000 bytes" in chunked.json()["error"]
    assert count_roots(store) == 0


# ---------------------------------------------------------------------- reads
def test_get_task_has_its_events_and_children(client: TestClient, runtime: Runtime) -> None:
    root = submit(client, agent="fanout", payload={"n": 2})
    drain(runtime)
    response = client.get(f"/tasks/{root['id']}")
    assert response.status_code == 200
    task = response.json()
    assert task["status"] == "done"
    assert [e["to_status"] for e in task["events"]][:3] == ["pending", "running", "waiting"]
    assert [e["to_status"] for e in task["events"]][-1] == "done"
    assert len(task["children"]) == 2 and {c["status"] for c in task["children"]} == {"done"}
    assert "model_calls" not in task
    assert client.get(f"/tasks/{root['id']}?model_calls=true").json()["model_calls"] == []


def test_a_missing_task_is_404_and_a_malformed_id_is_422(client: TestClient) -> None:
    missing = uuid.uuid4()
    response = client.get(f"/tasks/{missing}")
    assert response.status_code == 404
    assert response.json() == {"error": f"no task {missing}"}
    assert client.get(f"/trees/{missing}").status_code == 404
    assert client.post(f"/tasks/{missing}/resolve", json={"action": "done"}).status_code == 404
    bad = client.get("/tasks/not-a-uuid")
    assert bad.status_code == 422
    assert bad.json() == {"error": "task id 'not-a-uuid' is not a UUID"}
    assert client.get("/trees/1234").status_code == 422


def test_the_tree_endpoint_is_tree_json_of_the_stored_rows(client: TestClient,
                                                          runtime: Runtime) -> None:
    root = submit(client, agent="fanout", payload={"n": 3})
    drain(runtime)
    response = client.get(f"/trees/{root['id']}")
    assert response.status_code == 200
    tree = response.json()
    assert tree == as_json(tree_json(runtime.store.reads.tree_rows(uuid.UUID(root["id"]))))
    assert tree["status"] == "done" and len(tree["children"]) == 3
    assert tree["totals"]["tasks"] == 4 and tree["totals"]["by_status"] == {"done": 4}
    child = tree["children"][0]["id"]
    not_root = client.get(f"/trees/{child}")
    assert not_root.status_code == 404
    assert f"its tree is {root['id']}" in not_root.json()["error"]


def test_roots_lists_recent_roots_newest_first(client: TestClient) -> None:
    ids = [submit(client, prompt=f"goal {i}")["id"] for i in range(3)]
    roots = client.get("/roots?limit=2").json()
    assert [r["id"] for r in roots] == ids[::-1][:2]
    assert client.get("/roots?limit=0").status_code == 422


def test_metrics_have_the_seed_keys(client: TestClient, runtime: Runtime) -> None:
    submit(client)
    drain(runtime)
    metrics = client.get("/metrics").json()
    assert {"by_status", "avg_retry", "reclaimed_count", "avg_duration_seconds",
            "cost_by_route"} <= set(metrics)
    assert metrics["by_status"] == {"done": 1}


def test_healthz_is_200_with_the_database_and_503_without(client: TestClient,
                                                          runtime: Runtime) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "database": "ok"}
    dead = Store(create_db_engine("postgresql://postgres@127.0.0.1:1/nothing", pool_size=1))
    with TestClient(create_app(store=dead, settings=runtime.settings,
                               registry=runtime.registry)) as c:
        response = c.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"error": "database unavailable"}


# ---------------------------------------------------------------------- escalations
def escalated_root(client: TestClient, runtime: Runtime) -> dict[str, Any]:
    """A fanout root whose flaky children failed: it escalates itself."""
    root = submit(client, prompt="needs a person", agent="fanout",
                  payload={"n": 2, "child": "flaky"})
    drain(runtime)
    assert client.get(f"/tasks/{root['id']}").json()["status"] == "escalated"
    return root


def test_escalations_list_rule_error_root_and_goal_oldest_first(client: TestClient,
                                                               runtime: Runtime) -> None:
    root = escalated_root(client, runtime)
    policy = submit(client, prompt="write to bob@example.com")
    drain(runtime)
    items = client.get("/escalations").json()
    assert [i["id"] for i in items] == [root["id"], policy["id"]]
    assert items[0]["rule"] is None and items[0]["error"] == "2 children failed"
    assert items[0]["root_goal"] == "needs a person" and items[0]["root_id"] == root["id"]
    assert items[1]["rule"] == "forbidden_output"
    assert items[1]["error"].startswith("policy forbidden_output:")
    assert items[1]["escalated_at"] is not None


def test_resolve_done_then_again_is_refused_with_409(client: TestClient,
                                                     runtime: Runtime) -> None:
    root = escalated_root(client, runtime)
    response = client.post(f"/tasks/{root['id']}/resolve",
                           json={"action": "done", "note": "checked by hand"})
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "done"
    events = client.get(f"/tasks/{root['id']}").json()["events"]
    assert "checked by hand" in events[-1]["detail"]
    again = client.post(f"/tasks/{root['id']}/resolve", json={"action": "fail"})
    assert again.status_code == 409
    assert "not escalated" in again.json()["error"]
    assert client.get("/escalations").json() == []


def test_resolve_reassign_needs_a_known_agent(client: TestClient, runtime: Runtime) -> None:
    root = escalated_root(client, runtime)
    url = f"/tasks/{root['id']}/resolve"
    assert "needs 'agent'" in client.post(url, json={"action": "reassign"}).json()["error"]
    unknown = client.post(url, json={"action": "reassign", "agent": "fanot"})
    assert unknown.status_code == 422 and "did you mean 'fanout'" in unknown.json()["error"]
    stray = client.post(url, json={"action": "done", "agent": "echo"})
    assert stray.status_code == 422
    assert client.post(url, json={"action": "maybe"}).status_code == 422
    moved = client.post(url, json={"action": "reassign", "agent": "echo"})
    assert moved.status_code == 200, moved.text
    assert moved.json()["status"] == "pending" and moved.json()["agent"] == "echo"


# ---------------------------------------------------------------------- errors and auth
def test_unknown_routes_and_methods_answer_json(client: TestClient) -> None:
    assert client.get("/nowhere").json() == {"error": "no route GET /nowhere"}
    response = client.delete(f"/tasks/{uuid.uuid4()}")
    assert response.status_code == 405
    assert "not allowed" in response.json()["error"]


class ExplodingReads(Reads):
    def metrics(self) -> dict[str, Any]:
        raise RuntimeError("secret internals")


def test_an_unexpected_error_is_a_500_without_a_traceback(runtime: Runtime, db_url: str,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    store = Store(create_db_engine(db_url, pool_size=1))
    store.reads = ExplodingReads(store.database)
    with TestClient(create_app(store=store, settings=runtime.settings,
                               registry=runtime.registry)) as c:
        response = c.get("/metrics")
    store.dispose()
    assert response.status_code == 500
    assert response.json() == {"error": "internal error"}
    assert "secret" not in response.text and "Traceback" not in response.text
    assert "request failed" in caplog.text


def test_with_a_token_every_request_needs_the_bearer_header(runtime: Runtime) -> None:
    with make_client(runtime, api_token="s3cret") as c:
        bare = c.get("/metrics")
        assert bare.status_code == 401
        assert bare.headers["www-authenticate"].startswith("Bearer")
        assert "Authorization: Bearer" in bare.json()["error"]
        assert c.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.post("/tasks", json={"prompt": "x"}).status_code == 401
        assert c.get("/nowhere").status_code == 401
        # The query token opens pages only, never the API.
        assert c.get("/metrics?token=s3cret").status_code == 401
        assert c.get("/?token=s3cret").status_code == 200
        assert c.get("/").status_code == 401
        page = c.get(f"/ui/trees/{uuid.uuid4()}?token=s3cret")
        assert page.status_code == 200 and "app.js?token=s3cret" in page.text
        assert c.get("/ui/static/app.js?token=s3cret").status_code == 200
        assert c.get("/docs?token=s3cret").status_code == 200
        schema = c.get("/openapi.json?token=s3cret").json()
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_the_token_is_read_from_the_environment_at_creation(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORGCHART_API_TOKEN", "from-env")
    with make_client(runtime) as c:
        assert c.get("/healthz").status_code == 401
        assert c.get("/healthz", headers={"Authorization": "Bearer from-env"}).status_code == 200


# ---------------------------------------------------------------------- pages
def test_pages_are_served_with_a_strict_content_security_policy(client: TestClient) -> None:
    index = client.get("/")
    assert index.status_code == 200 and 'id="roots"' in index.text
    assert "script-src 'self'" in index.headers["content-security-policy"]
    root_id = uuid.uuid4()
    page = client.get(f"/ui/trees/{root_id}")
    assert page.status_code == 200
    assert f'data-root-id="{root_id}"' in page.text and 'id="root-status"' in page.text
    assert client.get("/ui/trees/nope").status_code == 422
    js = client.get("/ui/static/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert client.get("/ui/static/style.css").status_code == 200
    assert client.get("/ui/static/__init__.py").status_code == 404
    assert "swagger" in client.get("/docs").text.lower()
    assert "/tasks" in client.get("/openapi.json").json()["paths"]
