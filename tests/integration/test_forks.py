"""Forks: a branch re-runs a tree, replays the calls that did not change, never touches
the original; diffs pair the two trees task by task.

A planner with three writers (tests/fork_agents.py) on the offline backend, drained by
an in-process worker against a real PostgreSQL.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from agents.registry import UnknownAgent
from runtime.engine.agent_version import agent_version
from runtime.engine.store_ledger import StoreLedger
from runtime.errors import BadInput
from runtime.forks import fork
from runtime.forks.diff import diff_lines, diff_trees
from runtime.llm.handle import LLMFactory
from runtime.store.rows import NotFound
from runtime.store.store import Store
from runtime.wiring import Runtime
from tests.factories import expire_leases, submit
from tests.fork_agents import ForkWriter
from tests.support import drain

GOAL = {"goal": "harbour report"}


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime]) -> Runtime:
    return make_runtime(["tests.fork_agents"], ORGCHART_RETRY__MAX_RETRY="0")


def finished_tree(runtime: Runtime, payload: dict[str, Any] | None = None) -> uuid.UUID:
    root = submit(runtime.store, "fork_planner", payload or GOAL)
    drain(runtime)
    assert runtime.store.reads.get(root["id"])["status"] == "done"
    return uuid.UUID(str(root["id"]))


def dump(store: Store, root_id: uuid.UUID) -> tuple[list[str], list[str], list[str]]:
    """Every row, event and model call of a tree, as text (byte-for-byte comparison)."""
    with store.engine.connect() as conn:
        def texts(sql: str) -> list[str]:
            return [r[0] for r in conn.execute(sa.text(sql), {"root": root_id})]

        return (texts("SELECT row_to_json(t)::text FROM tasks t WHERE root_id = :root "
                      "ORDER BY id"),
                texts("SELECT row_to_json(e)::text FROM task_events e JOIN tasks t "
                      "ON t.id = e.task_id WHERE t.root_id = :root ORDER BY e.id"),
                texts("SELECT row_to_json(m)::text FROM model_calls m WHERE root_id = :root "
                      "ORDER BY id"))


def by_key(store: Store, root_id: uuid.UUID) -> dict[str, dict[str, Any]]:
    return {r["idempotency_key"] if r["parent_id"] else "/": r
            for r in store.reads.tree_rows(root_id)}


def calls(store: Store, root_id: uuid.UUID) -> tuple[int, int]:
    """(paid, replayed) model call rows of a tree."""
    rows = store.database.query("model_call_count_by_task", root_id=root_id)
    return sum(int(r["paid"]) for r in rows), sum(int(r["replayed"]) for r in rows)


def counts(store: Store) -> tuple[int, int, int]:
    with store.engine.connect() as conn:
        return tuple(int(conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one())
                     for t in ("tasks", "task_events", "model_calls"))  # type: ignore[return-value]


def test_a_rerun_replays_every_call_and_leaves_the_original_byte_for_byte(
        runtime: Runtime) -> None:
    original = finished_tree(runtime)
    before = dump(runtime.store, original)
    assert calls(runtime.store, original) == (4, 0)

    branch = fork(runtime.store, runtime.registry, runtime.settings, original, note="re-run")
    drain(runtime)

    assert dump(runtime.store, original) == before
    new = by_key(runtime.store, branch["id"])
    old = by_key(runtime.store, original)
    assert set(new) == {"/", "w0", "w1", "w2"}
    assert all(row["status"] == "done" for row in new.values())
    assert {k: r["forked_from"] for k, r in new.items()} == {k: r["id"] for k, r in old.items()}
    assert calls(runtime.store, branch["id"]) == (0, 4)
    assert new["/"]["spent_tokens"] == 0 and new["/"]["spent_usd"] == 0
    assert new["/"]["result"] == old["/"]["result"]
    assert new["/"]["budget_tokens"] == old["/"]["budget_tokens"]
    assert Decimal(new["/"]["budget_usd"]) == Decimal(old["/"]["budget_usd"])
    assert new["w1"]["agent_version"] == agent_version(ForkWriter)
    assert (runtime.store.reads.events(branch["id"])[0]["detail"]
            == f"forked from {original}: re-run")


def test_a_branch_root_of_an_approval_agent_waits_for_a_person(runtime: Runtime) -> None:
    original = finished_tree(runtime)
    runtime.store.policies.approval_agents = ("fork_planner",)
    branch = fork(runtime.store, runtime.registry, runtime.settings, original, note="again")
    assert branch["status"] == "awaiting_approval"
    assert runtime.store.reads.events(branch["id"])[0]["detail"] == (
        f"forked from {original}: again; held for approval (policy require_approval)")
    drain(runtime)
    assert runtime.store.reads.get(branch["id"])["status"] == "awaiting_approval"  # not claimed
    assert runtime.store.steering.approve(branch["id"], actor="dan").changed
    drain(runtime)
    assert runtime.store.reads.get(branch["id"])["status"] == "done"
    assert calls(runtime.store, branch["id"]) == (0, 4)  # approved, then replayed as usual


def test_a_branch_of_a_branch_replays_through_the_branch_in_between(runtime: Runtime) -> None:
    original = finished_tree(runtime)
    first = fork(runtime.store, runtime.registry, runtime.settings, original)
    drain(runtime)
    second = fork(runtime.store, runtime.registry, runtime.settings, first["id"])
    drain(runtime)

    assert calls(runtime.store, second["id"]) == (0, 4)
    links = {k: r["forked_from"] for k, r in by_key(runtime.store, second["id"]).items()}
    assert links == {k: r["id"] for k, r in by_key(runtime.store, first["id"]).items()}


def test_forking_the_root_with_another_agent_runs_that_agent(runtime: Runtime) -> None:
    original = finished_tree(runtime)
    branch = fork(runtime.store, runtime.registry, runtime.settings, original,
                  agent="fork_writer")
    drain(runtime)

    row = runtime.store.reads.get(branch["id"])
    assert row["to_agent"] == "fork_writer" and row["status"] == "done"
    assert row["payload"] == runtime.store.reads.get(original)["payload"]
    assert calls(runtime.store, branch["id"]) == (1, 0)  # a writer's question: never asked


def test_forking_one_writer_pays_its_call_and_the_aggregate_and_replays_the_rest(
        runtime: Runtime) -> None:
    original = finished_tree(runtime)
    writer = by_key(runtime.store, original)["w1"]

    branch = fork(runtime.store, runtime.registry, runtime.settings, writer["id"],
                  payload={"goal": "the lighthouse instead"})
    drain(runtime)

    new = by_key(runtime.store, branch["id"])
    assert new["w1"]["payload"] == {"goal": "the lighthouse instead"}
    assert new["w1"]["forked_from"] == writer["id"]
    assert new["w0"]["payload"] == by_key(runtime.store, original)["w0"]["payload"]
    paid = {k: r["own_tokens"] > 0 for k, r in new.items()}
    assert paid == {"/": True, "w0": False, "w1": True, "w2": False}
    assert calls(runtime.store, branch["id"]) == (2, 2)
    diff = diff_trees(runtime.store, original, branch["id"])
    changed = {p["path"]: p["changed"]["result"] for p in diff["pairs"]}
    # (the planner's offline reply quotes only the start of its prompt: it may not change)
    assert {k: v for k, v in changed.items() if k != "/"} == {
        "/w0": False, "/w1": True, "/w2": False}
    w1 = next(p for p in diff["pairs"] if p["path"] == "/w1")
    assert w1["b"]["calls_paid"] == 1 and w1["b"]["calls_replayed"] == 0
    assert diff["totals"]["b"]["calls_replayed"] == 2
    assert any("lighthouse" in line for line in diff_lines(diff))


def test_replayed_calls_are_marked_in_traces_and_the_timeline(runtime: Runtime) -> None:
    from runtime.telemetry.traces import build_spans
    from runtime.views import timeline_for

    original = finished_tree(runtime)
    branch = fork(runtime.store, runtime.registry, runtime.settings, original)
    drain(runtime)

    for root, replayed in ((original, False), (branch["id"], True)):
        ids = [r["id"] for r in runtime.store.reads.tree_rows(root)]
        calls = [s for s in build_spans(runtime.store.reads.trace_rows(ids))
                 if s.name.startswith("chat ")]
        assert len(calls) == 4
        assert {s.attributes["orgchart.replayed"] for s in calls} == {replayed}
        timeline = json.loads(timeline_for(runtime.store, root))
        marks = [len(c) == 3 and c[2] == 1 for t in timeline["tasks"] for c in t["calls"]]
        assert len(marks) == 4 and set(marks) == {replayed}


def test_a_fork_whose_override_fails_validation_creates_nothing(runtime: Runtime) -> None:
    original = finished_tree(runtime)
    writer = by_key(runtime.store, original)["w0"]
    before = counts(runtime.store)
    settings, registry, store = runtime.settings, runtime.registry, runtime.store

    with pytest.raises(BadInput, match="does not fit agent 'fork_writer'"):
        fork(store, registry, settings, writer["id"], payload={"topic": "no goal"})
    with pytest.raises(UnknownAgent):
        fork(store, registry, settings, writer["id"], agent="fork_writr")
    with pytest.raises(BadInput, match="unknown model 'gpt-nothing'"):
        fork(store, registry, settings, original, model="gpt-nothing")
    with pytest.raises(NotFound):
        fork(store, registry, settings, uuid.uuid4())
    with pytest.raises(BadInput, match="budget_tokens"):
        fork(store, registry, settings, original, budget_tokens=-1)

    assert counts(runtime.store) == before


def test_a_fork_of_a_tree_with_a_failed_subtree(runtime: Runtime) -> None:
    original = finished_tree(runtime, {"goal": "g", "fail_part": 1})
    old = by_key(runtime.store, original)
    assert old["w1"]["status"] == "failed" and old["/"]["result"]["drafts"] == 2
    before = dump(runtime.store, original)

    rerun = fork(runtime.store, runtime.registry, runtime.settings, original)
    fixed = fork(runtime.store, runtime.registry, runtime.settings, old["w1"]["id"],
                 payload={"goal": "g: part 1"})
    drain(runtime)

    assert dump(runtime.store, original) == before
    same = by_key(runtime.store, rerun["id"])
    assert same["w1"]["status"] == "failed" and same["w1"]["forked_from"] == old["w1"]["id"]
    assert calls(runtime.store, rerun["id"]) == (0, 3)
    healed = by_key(runtime.store, fixed["id"])
    assert healed["w1"]["status"] == "done" and healed["/"]["result"]["drafts"] == 3
    assert calls(runtime.store, fixed["id"]) == (2, 2)  # the healed writer, the aggregate


def test_a_fork_of_a_tree_with_a_cancelled_subtree(runtime: Runtime) -> None:
    root = submit(runtime.store, "fork_planner", {"goal": "g"})
    drain(runtime, agents=["fork_planner"])  # the writers are delegated, none ran yet
    w1 = by_key(runtime.store, root["id"])["w1"]
    runtime.store.steering.cancel(w1["id"], note="not needed")
    drain(runtime)
    old = by_key(runtime.store, root["id"])
    assert old["w1"]["status"] == "cancelled" and old["/"]["status"] == "done"
    assert old["/"]["result"]["drafts"] == 2
    before = dump(runtime.store, root["id"])

    branch = fork(runtime.store, runtime.registry, runtime.settings, root["id"])
    drain(runtime)

    assert dump(runtime.store, root["id"]) == before
    new = by_key(runtime.store, branch["id"])
    # The re-run runs the cancelled writer (its counterpart made no call: it is paid), and
    # the planner's aggregate now quotes three drafts (paid); the two others are replayed.
    assert new["w1"]["status"] == "done" and new["w1"]["forked_from"] == w1["id"]
    assert new["/"]["result"]["drafts"] == 3
    assert calls(runtime.store, branch["id"]) == (2, 2)


def test_a_fork_under_a_running_original(runtime: Runtime) -> None:
    root = submit(runtime.store, "fork_planner", {"goal": "slow", "sleep": 1.5})
    worker = runtime.worker(None, maintenance=False, listen=False, poll_interval_seconds=0.05)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not any(r["status"] == "running" and r["parent_id"]
                      for r in runtime.store.reads.tree_rows(root["id"])):
            assert time.monotonic() < deadline, "the writers never started"
            time.sleep(0.02)
        branch = fork(runtime.store, runtime.registry, runtime.settings, root["id"])
        while {runtime.store.reads.get(i)["status"]
               for i in (root["id"], branch["id"])} != {"done"}:
            assert time.monotonic() < deadline + 30, "the trees did not finish"
            time.sleep(0.05)
    finally:
        worker.stop("test over")
        thread.join(timeout=30)

    new, old = by_key(runtime.store, branch["id"]), by_key(runtime.store, root["id"])
    assert {k: r["forked_from"] for k, r in new.items()} == {k: r["id"] for k, r in old.items()}
    # The branch pays only what its counterparts had not answered yet when it asked.
    paid, replayed = calls(runtime.store, branch["id"])
    assert paid + replayed == 4
    # The original was not written by the branch: its own four paid calls, no link, and
    # each of its tasks ended once.
    assert calls(runtime.store, root["id"]) == (4, 0)
    assert all(r["forked_from"] is None for r in old.values())
    for row in old.values():
        finals = [e for e in runtime.store.reads.events(row["id"]) if e["to_status"] == "done"]
        assert len(finals) == 1


def test_a_redelivered_branch_task_is_never_charged_for_a_replayed_call(
        runtime: Runtime) -> None:
    original = submit(runtime.store, "fork_writer", {"goal": "one part"})
    drain(runtime)
    assert calls(runtime.store, original["id"]) == (1, 0)
    branch = fork(runtime.store, runtime.registry, runtime.settings, original["id"])
    store = runtime.store
    factory = LLMFactory(runtime.settings, StoreLedger(store), backend=None)
    try:
        for delivery in range(3):
            if delivery:
                expire_leases(store, where=f"id = '{branch['id']}'")
                store.hygiene.reap(max_delivery=10)
            (row,) = store.claims.claim(["fork_writer"], 1, f"w{delivery}", 30)
            assert row["id"] == branch["id"] and row["forked_from"] == original["id"]
            llm = factory.for_task(row, row["lease_token"], threading.Event())
            reply = llm.complete("Write a paragraph about one part", max_tokens=64)
            assert reply.replayed and reply.cost_usd == 0 and reply.prompt_tokens == 0
    finally:
        factory.close()
    rows = store.reads.model_calls(branch["id"])
    assert len(rows) == 3 and all(r["replayed"] for r in rows)
    assert sum(Decimal(r["cost_usd"]) for r in rows) == 0
    assert store.reads.get(branch["id"])["own_tokens"] == 0
    assert calls(store, original["id"]) == (1, 0)


def test_a_model_override_reaches_the_subtree_and_is_paid(runtime: Runtime) -> None:
    original = finished_tree(runtime)
    cloud = runtime.settings.models.cloud
    branch = fork(runtime.store, runtime.registry, runtime.settings, original, model=cloud)
    drain(runtime)

    new = by_key(runtime.store, branch["id"])
    assert all(r["model_override"] == cloud for r in new.values())
    assert all(r["model"] == cloud for r in new.values())
    paid, replayed = calls(runtime.store, branch["id"])
    local_calls = sum(1 for r in by_key(runtime.store, original).values()
                      if r["model"] != cloud)
    assert replayed == 4 - local_calls and paid == local_calls


def test_diff_flags_a_changed_agent_version(runtime: Runtime,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    original = finished_tree(runtime)
    monkeypatch.setattr(ForkWriter, "version", "writer-v2")
    branch = fork(runtime.store, runtime.registry, runtime.settings, original)
    drain(runtime)

    diff = diff_trees(runtime.store, original, branch["id"])
    flagged = {p["path"]: p["changed"]["version"] for p in diff["pairs"]}
    assert flagged == {"/": False, "/w0": True, "/w1": True, "/w2": True}
    assert any("CHANGED: version" in line for line in diff_lines(diff))
    with pytest.raises(BadInput, match="not a root"):
        diff_trees(runtime.store, original, by_key(runtime.store, original)["w0"]["id"])
