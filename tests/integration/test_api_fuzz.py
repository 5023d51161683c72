"""Hypothesis throws random bodies, ids and headers at every endpoint.

Whatever comes in, the API never answers 500 and every error is JSON ``{"error": str}``.
"""

from __future__ import annotations

import json
import urllib.parse
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.config import load_settings
from runtime.http.api import create_app
from runtime.store.store import Store
from runtime.wiring import build_runtime

with warnings.catch_warnings():  # starlette's notice about httpx2, at import time
    warnings.filterwarnings("ignore", message=".*httpx2")
    from fastapi.testclient import TestClient

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

json_scalars = (st.none() | st.booleans() | st.integers() | st.floats()
                | st.text(max_size=30) | st.decimals(allow_nan=False).map(str))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                           max_leaves=12)
agents = st.sampled_from(["echo", "fanout", "ceo", "", "nobody", "ECHO"]) | st.text(max_size=12)
submit_bodies = st.fixed_dictionaries({}, optional={
    "prompt": st.text(max_size=50) | json_values,
    "agent": agents | json_values,
    "type": st.none() | st.text(max_size=10),
    "priority": st.integers() | json_values,
    "budget_tokens": st.integers() | json_values,
    "budget_seconds": st.integers() | json_values,
    "budget_usd": st.decimals().map(str) | st.floats() | json_values,
    "payload": st.dictionaries(st.text(max_size=10), json_values, max_size=4) | json_values,
    "success_criteria": json_values,
    "kill_criteria": json_values,
}) | json_values
# Bodies that mostly pass validation, so the database sees odd but well-typed values.
plausible_bodies = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=50), "agent": st.sampled_from(["echo", "fanout"])},
    optional={
        "type": st.just("task") | st.text(max_size=5),
        "priority": st.integers(-2000, 2000),
        "budget_tokens": st.integers(-10, 2**40),
        "budget_usd": st.decimals(allow_nan=False, allow_infinity=False, places=4).map(str),
        "payload": st.dictionaries(st.text(max_size=10), json_values, max_size=4),
    })
resolve_bodies = st.fixed_dictionaries({}, optional={
    "action": st.sampled_from(["retry", "done", "fail", "reassign"]) | json_values,
    "agent": agents | json_values,
    "note": st.text(max_size=40) | json_values,
}) | json_values
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
ids = st.uuids().map(str) | st.text(max_size=40)


@pytest.fixture
def client(db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.delenv("ORGCHART_API_TOKEN", raising=False)
    cfg = load_settings(env={"ORGCHART_DATABASE_URL": db_url, "ORGCHART_LLM__BACKEND": "offline"})
    rt = build_runtime(cfg, ["tests.support_agents"], store=store)
    with TestClient(create_app(store=store, settings=cfg, registry=rt.registry)) as c:
        yield c


def check(response: Any) -> None:
    """No 500; a JSON body; every error is ``{"error": str}``."""
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"]


def path_part(text: str) -> str:
    return urllib.parse.quote(text, safe="")


@FUZZ
@given(body=plausible_bodies | submit_bodies, key=st.none() | header_text)
def test_post_tasks_never_errors_500(client: TestClient, body: Any, key: str | None) -> None:
    headers = {"Idempotency-Key": key} if key is not None else {}
    response = client.post("/tasks", content=json.dumps(body, allow_nan=True),
                           headers={"content-type": "application/json", **headers})
    check(response)
    if response.status_code in (200, 201):
        assert response.json()["status"] == "pending"


@FUZZ
@given(raw=st.binary(max_size=200), content_type=st.sampled_from(
    ["application/json", "text/plain", "application/x-www-form-urlencoded", ""]))
def test_raw_bytes_bodies_never_error_500(client: TestClient, raw: bytes,
                                          content_type: str) -> None:
    headers = {"content-type": content_type} if content_type else {}
    check(client.post("/tasks", content=raw, headers=headers))


@FUZZ
@given(task_id=ids, body=resolve_bodies)
def test_reads_and_resolve_never_error_500(client: TestClient, task_id: str, body: Any) -> None:
    part = path_part(task_id)
    for path in (f"/tasks/{part}", f"/trees/{part}", f"/ui/trees/{part}"):
        check(client.get(path))
    check(client.post(f"/tasks/{part}/resolve", content=json.dumps(body),
                      headers={"content-type": "application/json"}))


@FUZZ
@given(limit=st.text(max_size=12) | st.integers().map(str), model_calls=st.text(max_size=8))
def test_query_parameters_never_error_500(client: TestClient, limit: str,
                                          model_calls: str) -> None:
    check(client.get("/roots", params={"limit": limit}))
    check(client.get(f"/tasks/{uuid.uuid4()}", params={"model_calls": model_calls}))


@FUZZ
@given(authorization=header_text, token=st.none() | header_text,
       path=st.sampled_from(["/", "/metrics", "/escalations", "/healthz", "/tasks", "/docs",
                             f"/ui/trees/{uuid.UUID(int=1)}", "/ui/static/app.js"]))
def test_with_a_token_wrong_credentials_are_always_a_json_401(
        db_url: str, store: Store, authorization: str, token: str | None, path: str) -> None:
    cfg = load_settings(env={"ORGCHART_DATABASE_URL": db_url, "ORGCHART_LLM__BACKEND": "offline"})
    app = create_app(store=store, settings=cfg, api_token="right-token")
    with TestClient(app) as c:
        response = c.get(path, params={"token": token} if token is not None else None,
                         headers={"Authorization": authorization})
    check(response)
    assert response.status_code == 401
