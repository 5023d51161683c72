"""The OpenAPI document refuses what the server refuses, case by case.

Each case is one that schemathesis found: a request the document let through and the
server refused with 422 (or a 405 whose ``Allow`` left methods out). Each test checks
both sides: the body against the operation's schema in the document (jsonschema, the
document as the root of its refs), and the server's answer to it.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from runtime.config import load_settings
from runtime.http.api import create_app
from runtime.store.store import Store
from runtime.wiring import build_runtime

with warnings.catch_warnings():  # starlette's notice about httpx2, at import time
    warnings.filterwarnings("ignore", message=".*httpx2")
    from fastapi.testclient import TestClient


@pytest.fixture
def client(db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.delenv("ORGCHART_API_TOKEN", raising=False)
    cfg = load_settings(env={"ORGCHART_DATABASE_URL": db_url, "ORGCHART_LLM__BACKEND": "offline",
                             "ORGCHART_WEBHOOKS__ALLOW_PRIVATE": "true"})
    runtime = build_runtime(cfg, ["tests.support_agents"], store=store)
    with TestClient(create_app(store=store, settings=cfg, registry=runtime.registry)) as c:
        yield c


def fits(document: dict[str, Any], method: str, path: str, body: Any) -> bool:
    """Whether ``body`` fits the request body schema of an operation of ``document``."""
    schema = document["paths"][path][method]["requestBody"]["content"]["application/json"]
    root = {**document, **schema["schema"]}
    return jsonschema.Draft202012Validator(root).is_valid(body)


def header_fits(document: dict[str, Any], method: str, path: str, name: str,
                value: str) -> bool:
    """Whether ``value`` fits the schema of header ``name`` of an operation."""
    parameters = document["paths"][path][method]["parameters"]
    schema = next(p["schema"] for p in parameters if p["in"] == "header" and p["name"] == name)
    variants = schema.get("anyOf", [schema])
    return any(jsonschema.Draft202012Validator(v).is_valid(value) for v in variants)


def a_task(client: TestClient) -> str:
    made = client.post("/tasks", json={"prompt": "p", "agent": "echo"})
    assert made.status_code == 201, made.text
    return str(made.json()["id"])


def test_a_rejection_needs_a_note_that_is_not_blank(client: TestClient) -> None:
    document, task = client.app.openapi(), a_task(client)  # type: ignore[attr-defined]
    url = f"/tasks/{task}/reject"
    for body in ({}, {"note": ""}, {"note": "  \t"}):
        assert not fits(document, "post", "/tasks/{task_id}/reject", body), body
        assert client.post(url, json=body).status_code == 422
    assert fits(document, "post", "/tasks/{task_id}/reject", {"note": "no"})
    assert client.post(url, json={"note": "no"}).status_code == 200  # a no-op: not held


def test_a_fork_budget_in_dollars_is_a_number_or_a_string_of_digits(client: TestClient
                                                                    ) -> None:
    document, task = client.app.openapi(), a_task(client)  # type: ignore[attr-defined]
    for usd in ("", "lots", "-1", "1e3", -1, 1_000_000):
        assert not fits(document, "post", "/tasks/{task_id}/fork", {"budget_usd": usd}), usd
        assert client.post(f"/tasks/{task}/fork", json={"budget_usd": usd}).status_code == 422
    for usd in ("2.50", 2.5, 0):
        assert fits(document, "post", "/tasks/{task_id}/fork", {"budget_usd": usd})
        assert client.post(f"/tasks/{task}/fork", json={"budget_usd": usd}).status_code == 201


def test_an_idempotency_key_is_1_to_200_characters(client: TestClient) -> None:
    document = client.app.openapi()  # type: ignore[attr-defined]
    for key, status in (("", 422), ("k" * 201, 422), ("k", 201), ("k" * 200, 201)):
        assert header_fits(document, "post", "/tasks", "Idempotency-Key", key) == (status == 201)
        answer = client.post("/tasks", json={"prompt": "p", "agent": "echo"},
                             headers={"Idempotency-Key": key})
        assert answer.status_code == status, (len(key), answer.text)


@pytest.mark.parametrize("body", [
    {"name": "s1", "every": "1h"},  # neither goal nor fire
    {"name": "s2", "every": "1h", "goal": "g", "fire": True},  # both
    {"name": "s3", "goal": "g"},  # neither cron nor every
    {"name": "s4", "every": "1h", "cron": "0 7 * * *", "goal": "g"},  # both
    {"name": "s5", "every": "1h", "timezone": "Europe/Berlin", "goal": "g"},
    {"name": "s6", "every": "1h", "fire": True, "overlap": "cancel_previous"},
    {"name": "s7", "cron": "0 25 * * *", "goal": "g"},  # no 25th hour
    {"name": "s8", "every": "0s", "goal": "g"},
    {"name": "s9", "every": "1h", "goal": "g", "catchup_window": "8d"},
    {"name": "s10", "every": "1h", "goal": "g", "timezone": "Mars/Olympus"},
    {"name": "s11", "every": "1h", "goal": "g", "agent": "nobody"},
    {"name": "-bad", "every": "1h", "goal": "g"},
])
def test_a_schedule_the_document_refuses_is_refused(client: TestClient,
                                                      body: dict[str, Any]) -> None:
    document = client.app.openapi()  # type: ignore[attr-defined]
    assert not fits(document, "post", "/schedules", body)
    answer = client.post("/schedules", json=body)
    assert answer.status_code == 422, answer.text


@pytest.mark.parametrize("body", [
    {"name": "g1", "every": "1h", "goal": "g", "agent": "echo"},
    {"name": "g2", "cron": "0 7 * * MON-FRI", "timezone": "Europe/Berlin", "goal": "g"},
    {"name": "f1", "cron": "*/5 * * * *", "fire": True},
])
def test_a_schedule_the_document_takes_is_taken(client: TestClient,
                                                  body: dict[str, Any]) -> None:
    document = client.app.openapi()  # type: ignore[attr-defined]
    assert fits(document, "post", "/schedules", body)
    answer = client.post("/schedules", json=body)
    assert answer.status_code == 201, answer.text
    again = client.post("/schedules", json=body)  # the name is taken: a conflict
    assert again.status_code == 409, again.text


def test_resolve_takes_an_agent_with_reassign_only(client: TestClient) -> None:
    document, task = client.app.openapi(), a_task(client)  # type: ignore[attr-defined]
    path, url = "/tasks/{task_id}/resolve", f"/tasks/{task}/resolve"
    for body in ({"action": "done", "agent": "echo"}, {"action": "retry", "agent": ""},
                 {"action": "reassign"}, {"action": "reassign", "agent": "nobody"}):
        assert not fits(document, "post", path, body), body
        assert client.post(url, json=body).status_code == 422, body
    for body in ({"action": "done"}, {"action": "done", "agent": None},
                 {"action": "reassign", "agent": "echo"}):
        assert fits(document, "post", path, body), body
        assert client.post(url, json=body).status_code == 409, body  # not escalated


def test_a_webhook_url_is_http_or_https_with_a_host(client: TestClient) -> None:
    document = client.app.openapi()  # type: ignore[attr-defined]
    body = {"name": "hook", "events": ["task.*"], "secret_env": "HOOK_SECRET"}
    for url in ("ftp://example.com/x", "http://", "http://:80/x", "http://h:99999",
                "latency_seconds"):
        assert not fits(document, "post", "/webhooks", {**body, "url": url}), url
        assert client.post("/webhooks", json={**body, "url": url}).status_code == 422, url
    for events in (["task.bogus"], ["task.?uestion"], []):
        assert not fits(document, "post", "/webhooks", {**body, "url": "http://h",
                                                        "events": events})
    good = {**body, "url": "http://127.0.0.1:9/hook"}
    assert fits(document, "post", "/webhooks", good)
    assert client.post("/webhooks", json=good).status_code == 201


def test_a_root_goes_to_an_agent_the_server_knows_with_a_payload_it_takes(
        client: TestClient) -> None:
    document = client.app.openapi()  # type: ignore[attr-defined]
    for body in ({"prompt": "p", "agent": "nobody"},
                 {"prompt": "p", "agent": "ceo", "payload": {"colour": "red"}},
                 {"prompt": "p", "agent": "echo", "type": "research"},
                 {"prompt": "p", "agent": "echo", "payload": {"k": "nul\x00"}},
                 {"prompt": "p", "agent": "human"},
                 {"prompt": "p", "agent": "echo", "kill_criteria": {"max_tokens": -1}}):
        assert not fits(document, "post", "/tasks", body), body
        assert client.post("/tasks", json=body).status_code == 422, body
    for body in ({"prompt": "p"}, {"prompt": "p", "agent": "echo", "payload": {"k": [1]},
                                   "kill_criteria": {"max_tokens": 5.0}}):
        assert fits(document, "post", "/tasks", body), body
        assert client.post("/tasks", json=body).status_code == 201, body


def test_an_answer_to_a_task_that_is_no_question_is_a_conflict(client: TestClient) -> None:
    task = a_task(client)
    answer = client.post(f"/tasks/{task}/answer", json={"answer": "yes"})
    assert answer.status_code == 409, answer.text
    assert "only questions can be answered" in answer.json()["error"]


def test_a_fire_schedule_run_now_over_http_is_a_conflict(client: TestClient) -> None:
    made = client.post("/schedules", json={"name": "f", "every": "1h", "fire": True})
    assert made.status_code == 201, made.text
    assert client.post("/schedules/f/run-now").status_code == 409


def test_a_tree_depth_beyond_an_integer_is_refused_by_the_document_too(
        client: TestClient) -> None:
    document, task = client.app.openapi(), a_task(client)  # type: ignore[attr-defined]
    depth = next(p for p in document["paths"]["/trees/{root_id}"]["get"]["parameters"]
                 if p["name"] == "depth")
    assert not any(jsonschema.Draft202012Validator(v).is_valid(2**33)
                   for v in depth["schema"].get("anyOf", [depth["schema"]]))
    assert client.get(f"/trees/{task}", params={"depth": 2**33}).status_code == 422


@pytest.mark.parametrize("path", ["/schedules", "/webhooks", "/trees/{id}/pause"])
def test_a_405_allows_every_method_the_path_serves(client: TestClient, path: str) -> None:
    url = path.replace("{id}", str(uuid.uuid4()))
    answer = client.request("OPTIONS", url)
    assert answer.status_code == 405
    allowed = {m.strip() for m in answer.headers["allow"].split(",")}
    assert {"GET", "POST"} <= allowed, answer.headers["allow"]



def test_no_constraint_is_lost_on_the_way_to_the_document(client: TestClient) -> None:
    # pydantic writes a Field's ge/le into an Annotated type's schema as unknown keywords
    # ("ge": 1) in some spellings: the document would then say nothing of the limit.
    found: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("ge", "le", "gt", "lt") and not where.endswith("/properties"):
                    found.append(f"{where}/{key}")
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{where}/{index}")

    walk(client.app.openapi(), "")  # type: ignore[attr-defined]
    assert not found
