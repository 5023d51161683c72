"""The timeline and critical path of a tree, from the rows (``/trees/{id}/timeline``)."""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from runtime.http.api import create_app
from runtime.store.rows import NotFound
from runtime.store.store import Store
from runtime.views import critical_path_summary, timeline_for
from tests.timed_tree import build_timed_tree

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2")
    from fastapi.testclient import TestClient


@pytest.fixture
def client(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.delenv("ORGCHART_API_TOKEN", raising=False)
    with TestClient(create_app(store=store)) as c:
        yield c


def test_the_critical_path_is_the_chain_that_finished_last(store: Store) -> None:
    tree = build_timed_tree(store, leads=5, writers=4, slow_lead=3)
    data = json.loads(timeline_for(store, tree.root))
    assert data["critical_path"] == [str(t) for t in tree.critical]
    assert data["finished"] is True
    total = (tree.end - tree.t0).total_seconds()
    assert data["critical"]["total_seconds"] == pytest.approx(total, abs=0.002)
    # The path's own time: every phase of planner, lead-3 and its slow writer but
    # 'waiting' (which the next task on the path covers); queued is their queueing.
    by_id = {t["id"]: t for t in data["tasks"]}
    own = queued = 0.0
    for task_id in data["critical_path"]:
        for kind, start, end in by_id[task_id]["segments"]:
            own += 0 if kind == "waiting" else (end - start) / 1000
            queued += (end - start) / 1000 if kind == "queued" else 0
    assert data["critical"]["seconds"] == pytest.approx(own, abs=0.01)
    assert data["critical"]["queued_seconds"] == pytest.approx(queued, abs=0.01)
    assert data["critical"]["seconds"] <= data["critical"]["total_seconds"]
    assert data["summary"] == critical_path_summary(store, tree.root)
    assert data["summary"].startswith(f"critical path {own:.1f} s of {total:.1f} s; "
                                      f"{queued:.1f} s queued (planner > lead > wide_writer)")
    root = by_id[str(tree.root)]
    assert [s[0] for s in root["segments"]] == ["queued", "running", "waiting", "queued",
                                                "running", "judging"]
    assert root["start"] == 0 and root["end"] == round(total * 1000)
    writer = by_id[str(tree.critical[-1])]
    assert [s[0] for s in writer["segments"]] == ["queued", "running", "judging"]
    assert len(writer["calls"]) == 1
    call_start, call_end = writer["calls"][0]
    assert writer["segments"][1][1] <= call_start < call_end == writer["segments"][1][2]
    assert len(data["tasks"]) == 1 + 5 + 20
    assert [t["depth"] for t in data["tasks"]] == sorted(t["depth"] for t in data["tasks"])


def test_an_unfinished_tree_runs_to_now(store: Store) -> None:
    tree = build_timed_tree(store, leads=2, writers=2)
    with store.database.transaction() as conn:  # the root is still waiting for its children
        conn.execute(sa.text("UPDATE tasks SET status = 'waiting', completed_at = NULL "
                             "WHERE id = :id"), {"id": tree.root})
        conn.execute(sa.text("DELETE FROM task_events WHERE task_id = :id AND to_status IN "
                             "('ready_to_aggregate', 'judging', 'done') OR (task_id = :id AND "
                             "from_status = 'ready_to_aggregate')"), {"id": tree.root})
    data = json.loads(timeline_for(store, tree.root))
    assert data["finished"] is False and data["summary"].endswith(" so far")
    root = data["tasks"][0]
    assert root["segments"][-1][0] == "waiting"
    assert root["end"] == root["segments"][-1][2] >= round(data["now"] * 1000) - 1
    assert data["end"] == pytest.approx(data["now"], abs=0.01)


def test_the_timeline_endpoint_and_its_errors(client: TestClient, store: Store) -> None:
    tree = build_timed_tree(store, leads=2, writers=3)
    response = client.get(f"/trees/{tree.root}/timeline")
    assert response.status_code == 200
    assert response.json()["summary"].startswith("critical path ")
    assert client.get(f"/trees/{uuid.uuid4()}/timeline").status_code == 404
    child = client.get(f"/trees/{tree.ids['lead-0']}/timeline")
    assert child.status_code == 404 and f"its tree is {tree.root}" in child.json()["error"]
    with pytest.raises(NotFound):
        critical_path_summary(store, uuid.uuid4())
