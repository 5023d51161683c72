"""``GET /metrics`` as a Prometheus scrape, parsed with prometheus_client's own parsers."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from runtime.config import load_settings
from runtime.http.api import create_app
from runtime.store.store import Store
from runtime.wiring import Runtime, build_runtime
from tests import factories
from tests.timed_tree import build_timed_tree

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2")
    from fastapi.testclient import TestClient

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


@pytest.fixture
def client(db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.delenv("ORGCHART_API_TOKEN", raising=False)
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "offline"})
    rt: Runtime = build_runtime(settings, ["tests.support_agents"], store=store)
    with TestClient(create_app(store=store, settings=settings, registry=rt.registry)) as c:
        yield c


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(found: dict[Any, float], name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def test_json_stays_the_default(client: TestClient) -> None:
    for accept in (None, "application/json", "*/*"):
        headers = {"Accept": accept} if accept else {}
        response = client.get("/metrics", headers=headers)
        assert response.headers["content-type"].startswith("application/json")
        assert "by_status" in response.json()


def test_a_scrape_parses_and_counts_what_happened_since_the_first(client: TestClient,
                                                                  store: Store) -> None:
    first = client.get("/metrics", headers={"Accept": "text/plain"})
    assert first.status_code == 200
    assert first.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert value(samples(first.text), "orgchart_task_transitions_total",
                 from_status="pending", to_status="running", agent="planner") == 0
    tree = build_timed_tree(store, leads=3, writers=4)
    queued = factories.submit(store, "echo")
    factories.submit(store, "echo")
    claimed = store.claims.claim(["echo"], 1, "w-prom", 30)
    assert claimed
    text = client.get("/metrics", headers={"Accept": "text/plain"}).text
    found = samples(text)
    assert value(found, "orgchart_task_transitions_total", from_status="pending",
                 to_status="running", agent="wide_writer") == 12
    assert value(found, "orgchart_task_transitions_total", from_status="judging",
                 to_status="done", agent="lead") == 3
    assert value(found, "orgchart_task_transitions_total", from_status="none",
                 to_status="pending", agent="echo") == 2
    # Every finished task's wall time is in the histogram, in the right bucket.
    assert value(found, "orgchart_task_duration_seconds_count", agent="wide_writer",
                 status="done") == 12
    assert value(found, "orgchart_task_duration_seconds_bucket", agent="wide_writer",
                 status="done", le="1.0") == 0
    assert value(found, "orgchart_task_duration_seconds_bucket", agent="wide_writer",
                 status="done", le="2.5") == 12
    assert value(found, "orgchart_model_calls_total", route="local",
                 model="qwen3:0.6b") == tree.calls == 16
    assert value(found, "orgchart_model_tokens_total", route="local", model="qwen3:0.6b",
                 direction="input") == 1600
    assert value(found, "orgchart_model_cost_usd_total", route="local",
                 model="qwen3:0.6b") == pytest.approx(16 * 0.0012)
    assert value(found, "orgchart_model_call_duration_seconds_count", route="local",
                 model="qwen3:0.6b") == 16
    assert value(found, "orgchart_tasks", status="pending", agent="echo") == 1
    assert value(found, "orgchart_tasks", status="running", agent="echo") == 1
    assert value(found, "orgchart_queue_depth", agent="echo") == 1
    assert value(found, "orgchart_worker_tasks_in_flight", worker="w-prom",
                 status="running") == 1
    assert 0 <= value(found, "orgchart_queue_oldest_age_seconds", agent="echo") < 60
    assert queued["status"] == "pending"
    # A third scrape adds nothing new: counters are cumulative, not doubled.
    again = samples(client.get("/metrics", headers={"Accept": "text/plain"}).text)
    assert value(again, "orgchart_model_calls_total", route="local",
                 model="qwen3:0.6b") == 16


def test_reaped_and_poisoned_are_counted(client: TestClient, store: Store) -> None:
    client.get("/metrics", headers={"Accept": "text/plain"})
    factories.submit(store, "echo")
    factories.submit(store, "echo")
    store.claims.claim(["echo"], 2, "w-dead", 30)
    with store.database.transaction() as conn:  # one was already delivered too often: poison
        conn.execute(sa.text(
            "UPDATE tasks SET delivery_count = 99 WHERE id = (SELECT id FROM tasks "
            "WHERE status = 'running' ORDER BY id LIMIT 1)"))
    factories.expire_leases(store)
    store.hygiene.reap(limit=10, max_delivery=3, worker="reaper")
    found = samples(client.get("/metrics", headers={"Accept": "text/plain"}).text)
    assert value(found, "orgchart_tasks_reaped_total", agent="echo") == 2
    assert value(found, "orgchart_tasks_poisoned_total", agent="echo") == 1


def test_openmetrics_for_prometheus_own_accept_header(client: TestClient) -> None:
    response = client.get("/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    names = {f.name for f in openmetrics_families(response.text)}
    assert {"orgchart_tasks", "orgchart_task_transitions", "orgchart_model_calls",
            "orgchart_model_call_duration_seconds", "orgchart_task_duration_seconds"} <= names


def test_the_grafana_dashboard_only_uses_metrics_a_scrape_has(client: TestClient,
                                                              store: Store) -> None:
    import json
    import re
    from pathlib import Path

    client.get("/metrics", headers={"Accept": "text/plain"})
    build_timed_tree(store, leads=1, writers=1)
    factories.submit(store, "echo")
    store.claims.claim(["echo"], 1, "w-dash", 30)
    factories.submit(store, "echo")
    text = client.get("/metrics", headers={"Accept": "text/plain"}).text
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = json.loads((Path(__file__).parents[2] / "docs" / "grafana-dashboard.json")
                           .read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"orgchart_[a-z_]+", e)}
    assert used and used <= exposed, used - exposed
