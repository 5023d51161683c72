"""Fast tree reads: JSON built in the database, subtrees, and the change feed."""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from runtime.store.reads import PARALLEL_TREE_NODES
from runtime.store.store import Store
from runtime.views import tree_json, tree_text
from runtime.wiring import Runtime
from tests.support import drain
from tests.timed_tree import build_timed_tree

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2")
    from fastapi.testclient import TestClient


def as_json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def find(node: dict[str, Any], task_id: str) -> dict[str, Any] | None:
    if node["id"] == task_id:
        return node
    for child in node["children"]:
        hit = find(child, task_id)
        if hit is not None:
            return hit
    return None


def test_the_database_built_tree_equals_the_python_one_on_odd_values(store: Store) -> None:
    tree = build_timed_tree(store, leads=3, writers=4)
    # Values whose formatting differs easily: unicode and quotes, whole and fractional
    # budgets, a timestamp on a whole second, NULLs, an error text, a long duration.
    with store.database.transaction() as conn:
        conn.execute(sa.text(
            "UPDATE tasks SET error = :e, budget_usd = 10, duration_seconds = 1.23456789, "
            "started_at = date_trunc('second', started_at), route = NULL, "
            "payload = CAST(:p AS jsonb), success_criteria = '{\"checks\": []}' "
            "WHERE id = :id"), {"e": 'bad "quote" \\ ünïcode ✓\n', "id": tree.ids["lead-1"],
                                 "p": json.dumps({"goal": "é \u2028 \"x\"", "n": [1.5, None]})})
        conn.execute(sa.text("UPDATE tasks SET budget_usd = 0.1234, priority = NULL "
                             "WHERE id = :id"), {"id": tree.ids["writer-0-0"]})
    text, last_event = tree_text(store, tree.root)
    assert json.loads(text) == as_json(tree_json(store.reads.tree_rows(tree.root)))
    assert last_event == store.fires.event_watermark() > 0
    lead = find(json.loads(text), str(tree.ids["lead-1"]))
    assert lead is not None and lead["budget_usd"] == "10" and lead["duration_seconds"] == 1.234568
    # Siblings created together come in id order, as PostgreSQL orders uuids.
    assert [c["id"] for c in lead["children"]] == sorted(str(tree.ids[f"writer-1-{j}"])
                                                         for j in range(4))


def test_subtree_and_depth(client: TestClient, store: Store) -> None:
    tree = build_timed_tree(store, leads=3, writers=4)
    lead = tree.ids["lead-2"]
    whole = client.get(f"/trees/{tree.root}").json()
    response = client.get(f"/trees/{tree.root}", params={"under": str(lead)})
    assert response.status_code == 200, response.text
    sub = response.json()
    expected = find(whole, str(lead))
    assert expected is not None
    assert {k: v for k, v in sub.items() if k != "totals"} == expected
    assert sub["totals"]["tasks"] == 5 and sub["totals"]["by_status"] == {"done": 5}
    assert sub["totals"]["spent_usd"] == f"{Decimal('0.0012') * 5:.8f}"
    top = client.get(f"/trees/{tree.root}", params={"depth": 1}).json()
    assert top["totals"]["tasks"] == 4
    assert all(c["children"] == [] for c in top["children"])
    only = client.get(f"/trees/{tree.root}", params={"under": str(lead), "depth": 0}).json()
    assert only["children"] == [] and only["totals"]["tasks"] == 1
    other = build_timed_tree(store, leads=1, writers=1, seed=2)
    missing = client.get(f"/trees/{tree.root}", params={"under": str(other.ids["lead-0"])})
    assert missing.status_code == 404 and "not in tree" in missing.json()["error"]
    assert client.get(f"/trees/{tree.root}", params={"depth": -1}).status_code == 422


def test_the_change_feed_names_what_changed_since_a_cursor(client: TestClient,
                                                           runtime: Runtime) -> None:
    root = client.post("/tasks", json={"prompt": "p", "agent": "fanout",
                                       "payload": {"n": 2}}).json()
    first = client.get(f"/trees/{root['id']}")
    cursor = int(first.headers["x-orgchart-last-event"])
    assert first.json()["totals"]["tasks"] == 1
    unrelated = client.post("/tasks", json={"prompt": "q", "agent": "echo"}).json()
    drain(runtime)
    changes = client.get(f"/trees/{root['id']}/events", params={"after": cursor}).json()
    assert changes["last_event_id"] > cursor and not changes["more"]
    ids = {t["id"] for t in changes["tasks"]}
    assert root["id"] in ids and len(ids) == 3 and unrelated["id"] not in ids
    assert all(e["task_id"] in ids for e in changes["events"])
    assert [t["status"] for t in changes["tasks"]] == ["done"] * 3
    assert {e["to_status"] for e in changes["events"]} >= {"running", "waiting", "done"}
    again = client.get(f"/trees/{root['id']}/events",
                       params={"after": changes["last_event_id"]}).json()
    assert again["events"] == [] and again["tasks"] == []
    assert again["last_event_id"] == changes["last_event_id"]
    paged = client.get(f"/trees/{root['id']}/events", params={"after": cursor,
                                                              "limit": 2}).json()
    assert paged["more"] and len(paged["events"]) == 2


def test_a_missing_or_non_root_tree_is_404(client: TestClient, store: Store) -> None:
    tree = build_timed_tree(store, leads=1, writers=1)
    assert client.get(f"/trees/{uuid.uuid4()}").status_code == 404
    child = client.get(f"/trees/{tree.ids['lead-0']}")
    assert child.status_code == 404 and f"its tree is {tree.root}" in child.json()["error"]


def test_a_follower_sees_the_same_tree_as_a_whole_read_at_every_step(runtime: Runtime) -> None:
    from runtime.views import TreeFollower, tree_for

    store = runtime.store
    root = store.tasks.submit(build_root_task(runtime), actor="test")[0]["id"]
    follower = TreeFollower(store, root, full_every=1000)
    worker = runtime.worker(None, maintenance=False, listen=False, batch_size=1,
                            sync_threads=1)
    steps = 0
    for _ in range(100):
        seen = follower.refresh()
        whole = tree_for(store, root)
        # Spend rolled up into ancestors has no event of its own: compare the rest.
        assert strip_spend(seen) == strip_spend(whole)
        if seen["status"] == "done":
            break
        if worker.run_once() == 0:
            store.hygiene.sweep()
        steps += 1
    assert follower.refresh() == tree_for(store, root)  # the final whole read
    assert steps > 3 and follower.tree is not None and follower.tree["totals"]["tasks"] == 9


def build_root_task(runtime: Runtime) -> Any:
    from runtime.wiring import build_root

    return build_root(runtime.registry, runtime.settings, goal="g", agent="fanout",
                      payload={"n": 2, "child": "fanout"})


def strip_spend(node: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in node.items() if k not in ("spent_tokens", "spent_usd", "children")}
    out["children"] = [strip_spend(c) for c in node["children"]]
    return out


def test_a_big_tree_read_in_parts_equals_the_python_one(
        store: Store) -> None:
    root = uuid.uuid4()
    with store.database.transaction() as conn:
        conn.execute(sa.text(
            "INSERT INTO tasks (id, root_id, to_agent, type, payload, status, depth, "
            "own_tokens, own_usd, duration_seconds, completed_at) VALUES (:r, :r, 'ceo', "
            "'goal', '{\"goal\": \"big\"}', 'done', 0, 7, 0.5, 1.5, now())"), {"r": root})
        conn.execute(sa.text(
            "INSERT INTO tasks (id, parent_id, root_id, to_agent, type, payload, status, "
            "depth, result, own_tokens, own_usd, duration_seconds, idempotency_key, "
            "started_at) SELECT gen_random_uuid(), :r, :r, 'scout', 'task', "
            "jsonb_build_object('goal', 'leaf ' || i), "
            "CASE WHEN i % 3 = 0 THEN 'failed' ELSE 'done' END, 1, "
            "jsonb_build_object('n', i), i, i * 0.001, i * 0.01, 'k' || i, now() "
            "FROM generate_series(1, :n) AS i"), {"r": root, "n": PARALLEL_TREE_NODES})
    text, _ = tree_text(store, root)
    tree = json.loads(text)
    assert tree == as_json(tree_json(store.reads.tree_rows(root)))
    assert tree["totals"]["tasks"] == PARALLEL_TREE_NODES + 1
    assert tree["totals"]["by_status"] == {"done": 1 + PARALLEL_TREE_NODES
                                           - PARALLEL_TREE_NODES // 3,
                                           "failed": PARALLEL_TREE_NODES // 3}


SUMMARY_FIELDS = {
    "id", "parent_id", "agent", "type", "status", "depth", "spent_tokens", "spent_usd",
    "own_tokens", "own_usd", "duration_seconds", "goal", "has_result", "verdict_passed",
    "verdict_score", "error", "route", "model", "served_by", "cost_estimated", "forked_from",
    "tenant", "children",
}
#: The summary's fields taken as they are from the full shape.
SHARED_FIELDS = SUMMARY_FIELDS - {"goal", "has_result", "verdict_passed", "verdict_score",
                                  "error", "children"}


def walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node["children"]:
        yield from walk(child)


def check_summary(summary: dict[str, Any], full: dict[str, Any]) -> None:
    """Every summary node is its full node's summary, in the same places."""
    assert summary["totals"] == full["totals"]
    pairs = list(zip(walk(summary), walk(full), strict=True))
    for small, whole in pairs:
        assert set(small) - {"totals"} == SUMMARY_FIELDS, set(small) ^ SUMMARY_FIELDS
        assert {k: small[k] for k in SHARED_FIELDS} == {k: whole[k] for k in SHARED_FIELDS}
        goal = (whole["payload"] or {}).get("goal")
        assert small["goal"] == (goal[:200] if isinstance(goal, str) else goal)
        assert small["has_result"] is (whole["result"] is not None)
        verdict = whole["verdict"] or {}
        assert (small["verdict_passed"], small["verdict_score"]) == (
            verdict.get("passed"), verdict.get("score"))
        assert small["error"] == (whole["error"][:500] if whole["error"] else None)
        assert [c["id"] for c in small["children"]] == [c["id"] for c in whole["children"]]


def test_the_summary_shape_is_the_tree_without_what_agents_wrote(client: TestClient,
                                                                 store: Store) -> None:
    tree = build_timed_tree(store, leads=3, writers=4)
    lead, writer = tree.ids["lead-1"], tree.ids["writer-1-2"]
    with store.database.transaction() as conn:  # a long goal, a long error, a verdict, no result
        conn.execute(sa.text(
            "UPDATE tasks SET payload = CAST(:p AS jsonb), error = :e, "
            "verdict = CAST(:v AS jsonb) WHERE id = :id"),
            {"id": lead, "p": json.dumps({"goal": "é \"q\" " * 60, "context": "x" * 900}),
             "e": "bad \"quote\" ✓\n" * 80,
             "v": json.dumps({"passed": False, "score": 0.25, "reasons": ["thin"]})})
        conn.execute(sa.text("UPDATE tasks SET result = NULL, payload = '{}' WHERE id = :id"),
                     {"id": writer})
    full = client.get(f"/trees/{tree.root}")
    assert full.json() == client.get(f"/trees/{tree.root}", params={"fields": "full"}).json()
    response = client.get(f"/trees/{tree.root}", params={"fields": "summary"})
    assert response.status_code == 200, response.text
    assert int(response.headers["x-orgchart-last-event"]) > 0
    summary = response.json()
    check_summary(summary, full.json())
    nodes = {n["id"]: n for n in walk(summary)}
    assert len(nodes[str(lead)]["goal"]) == 200 and len(nodes[str(lead)]["error"]) == 500
    assert nodes[str(lead)]["verdict_passed"] is False
    assert nodes[str(writer)]["has_result"] is False and nodes[str(writer)]["goal"] is None
    # a subtree, and a depth, in the summary shape
    sub = client.get(f"/trees/{tree.root}", params={"under": str(lead), "fields": "summary"})
    whole_sub = client.get(f"/trees/{tree.root}", params={"under": str(lead)})
    check_summary(sub.json(), whole_sub.json())
    top = client.get(f"/trees/{tree.root}", params={"depth": 1, "fields": "summary"}).json()
    assert top["totals"]["tasks"] == 4 and all(c["children"] == [] for c in top["children"])


def test_a_big_tree_in_the_summary_shape_is_read_in_parts(store: Store) -> None:
    root = uuid.uuid4()
    with store.database.transaction() as conn:
        conn.execute(sa.text(
            "INSERT INTO tasks (id, root_id, to_agent, type, payload, status, depth) "
            "VALUES (:r, :r, 'ceo', 'goal', '{\"goal\": \"big\"}', 'done', 0)"), {"r": root})
        conn.execute(sa.text(
            "INSERT INTO tasks (id, parent_id, root_id, to_agent, type, payload, status, "
            "depth, result, verdict, idempotency_key) SELECT gen_random_uuid(), :r, :r, "
            "'scout', 'task', jsonb_build_object('goal', 'leaf ' || i), 'done', 1, "
            "jsonb_build_object('n', i), jsonb_build_object('passed', i % 2 = 0, 'score', i), "
            "'k' || i FROM generate_series(1, :n) AS i"), {"r": root, "n": PARALLEL_TREE_NODES})
    summary = json.loads(tree_text(store, root, fields="summary")[0])
    check_summary(summary, json.loads(tree_text(store, root)[0]))
    assert summary["totals"]["tasks"] == PARALLEL_TREE_NODES + 1


@pytest.mark.parametrize("value", ["Summary", "payload", "", "full,summary"])
def test_an_unknown_fields_value_is_422_and_names_the_choices(client: TestClient,
                                                              store: Store,
                                                              value: str) -> None:
    tree = build_timed_tree(store, leads=1, writers=1)
    response = client.get(f"/trees/{tree.root}", params={"fields": value})
    assert response.status_code == 422, response.text
    assert "summary" in response.text
    from runtime.errors import BadInput

    with pytest.raises(BadInput, match="fields must be one of full, summary"):
        tree_text(store, tree.root, fields=value)
