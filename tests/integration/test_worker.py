"""The worker loop against a real PostgreSQL, with the offline model and test agents."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agents.base import Agent, Result, TaskView
from agents.context import AgentContext
from runtime.store.queries import TASKS_CHANNEL
from runtime.store.rows import RunOutcome
from runtime.store.store import Store
from runtime.wiring import Runtime
from tests.factories import (
    backdate_claims,
    child_rows,
    events,
    expire_leases,
    submit,
    terminal_event_counts,
)
from tests.support import drain, wait_until
from tests.support_agents import AnyInput, AnyOutput

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-agents.md"


class AsyncNapper(Agent):
    """``async def run``: naps ``nap`` seconds on the loop; counts how many nap at once."""

    name = "async_napper"
    input_model = AnyInput
    output_model = AnyOutput
    now = 0
    peak = 0

    async def run(self, ctx: AgentContext, task: TaskView) -> Result:
        cls = type(self)
        cls.now += 1  # one event loop: no lock needed
        cls.peak = max(cls.peak, cls.now)
        try:
            await asyncio.sleep(float(task.payload.get("nap", 0.5)))
        finally:
            cls.now -= 1
        return Result({"napped": True})


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime]) -> Runtime:
    return make_runtime(ORGCHART_RETRY__MAX_RETRY="2")


def test_a_root_goes_pending_running_judging_done(runtime: Runtime) -> None:
    task = submit(runtime.store, "echo", {"goal": "hi"},
                  success_criteria={"checks": [{"path": "echo", "op": "==", "value": "hi"}]})
    drain(runtime)
    row = runtime.store.reads.get(task["id"])
    assert row["status"] == "done"
    assert row["result"]["echo"] == "hi"
    assert row["verdict"]["passed"] is True
    assert events(runtime.store, task["id"]) == [
        (None, "pending"), ("pending", "running"), ("running", "judging"), ("judging", "done")]


def test_a_root_with_nothing_to_judge_goes_from_running_to_done(runtime: Runtime) -> None:
    """No criteria, the rules judge: one transition; its verdict and its event say why."""
    task = submit(runtime.store, "echo", {"goal": "hi"})
    drain(runtime)
    row = runtime.store.reads.get(task["id"])
    assert row["status"] == "done"
    assert row["verdict"]["passed"] is True
    assert row["verdict"]["reasons"] == ["no success criteria: accepted"]
    history = runtime.store.reads.events(task["id"])
    assert [(e["from_status"], e["to_status"]) for e in history] == [
        (None, "pending"), ("pending", "running"), ("running", "done")]
    assert history[-1]["detail"] == "verdict: done (no criteria to judge)"


def test_fan_out_and_fan_in_end_to_end(runtime: Runtime) -> None:
    root = submit(runtime.store, "fanout", {"goal": "g", "n": 4})
    drain(runtime)
    row = runtime.store.reads.get(root["id"])
    assert row["status"] == "done", row["error"]
    assert row["result"] == {"parts": 4}
    children = runtime.store.reads.children(root["id"])
    assert len(children) == 4 and all(c["status"] == "done" for c in children)
    assert all(c["depth"] == 1 and c["root_id"] == root["id"] for c in children)
    # Budgets were carved from the root's: four shares plus one kept for the aggregate.
    assert sum(c["budget_tokens"] for c in children) <= root["budget_tokens"]
    assert children[0]["budget_tokens"] == root["budget_tokens"] // 5
    assert all(n == 1 for n in terminal_event_counts(runtime.store).values())


def test_a_transient_error_retries_with_backoff_then_fails(runtime: Runtime) -> None:
    task = submit(runtime.store, "flaky")
    worker = runtime.worker(["flaky"], maintenance=False, listen=False)
    delays = []
    for _ in range(3):
        assert worker.run_once() == 1
        row = runtime.store.reads.get(task["id"])
        if row["status"] != "pending":
            break
        with runtime.store.engine.connect() as conn:
            delays.append(round(float(conn.execute(sa.text(
                "SELECT extract(epoch FROM available_at - now()) FROM tasks WHERE id = :id"),
                {"id": task["id"]}).scalar())))
        with runtime.store.database.transaction() as conn:
            conn.execute(sa.text("UPDATE tasks SET available_at = now()"))
    row = runtime.store.reads.get(task["id"])
    assert delays == [1, 2]  # 2**0, 2**1
    assert row["status"] == "failed" and row["retry_count"] == 2
    assert "transient error persisted after 2 retries" in row["error"]


def test_a_lost_database_connection_in_the_agent_is_retried_not_failed(runtime: Runtime) -> None:
    # psycopg's own OperationalError (the async step writer's, a record look-up's during a
    # server restart) is infrastructure: the task goes back to pending, as SQLAlchemy's does.
    task = submit(runtime.store, "dbgone")
    worker = runtime.worker(["dbgone"], maintenance=False, listen=False)
    assert worker.run_once() == 1
    row = runtime.store.reads.get(task["id"])
    assert row["status"] == "pending" and row["retry_count"] == 1, row
    assert row["error"].startswith("transient: connection failed"), row["error"]


def test_an_agent_exception_fails_the_task_and_is_not_retried(runtime: Runtime) -> None:
    task = submit(runtime.store, "boom")
    drain(runtime)
    row = runtime.store.reads.get(task["id"])
    assert row["status"] == "failed" and row["retry_count"] == 0
    assert row["error"] == "agent error: RuntimeError: kaboom"


def test_a_task_for_an_unregistered_agent_fails_with_a_suggestion(runtime: Runtime) -> None:
    task = submit(runtime.store, "ecko")
    worker = runtime.worker(["echo"], maintenance=False, listen=False)
    # Claim it by hand as a worker for 'ecko' would.
    (row,) = runtime.store.claims.claim(["ecko"], 1, "w", 30)
    action = worker.executor.execute(row, threading.Event())
    worker.apply([action])
    fresh = runtime.store.reads.get(task["id"])
    assert fresh["status"] == "failed" and "did you mean 'echo'" in fresh["error"]


def test_aggregate_can_retry_failed_children_on_another_agent(runtime: Runtime) -> None:
    root = submit(runtime.store, "fanout", {"goal": "g", "n": 2, "child": "boom",
                                            "retry_failed": True})
    drain(runtime)
    row = runtime.store.reads.get(root["id"])
    assert row["status"] == "done", row["error"]
    children = runtime.store.reads.children(root["id"])
    assert {c["to_agent"] for c in children} == {"echo"}
    assert len(children) == 2
    assert all(c["retry_count"] == 1 for c in children)  # what ChildView.retries reads


def test_a_retry_whose_children_could_overspend_the_parent_is_refused(
        runtime: Runtime) -> None:
    root = submit(runtime.store, "fanout", {"goal": "g", "n": 2, "child": "boom",
                                            "retry_failed": True})
    worker = runtime.worker(None, maintenance=False, listen=False)
    assert worker.run_once() == 1  # the parent delegates
    # Each child could now spend the whole tree's:
    with runtime.store.database.transaction() as conn:
        conn.execute(sa.text("UPDATE tasks SET budget_tokens = :b WHERE parent_id = :p"),
                     {"b": root["budget_tokens"], "p": root["id"]})
    drain(runtime)
    row = runtime.store.reads.get(root["id"])
    assert row["status"] == "failed", row["error"]
    assert row["error"].startswith("delegation refused: budget: retrying 2 children")
    assert [c["retry_count"] for c in runtime.store.reads.children(root["id"])] == [0, 0]


def test_stop_releases_what_the_worker_still_holds(runtime: Runtime) -> None:
    task = submit(runtime.store, "echo", {"goal": "slow", "sleep": 3})
    worker = runtime.worker(["echo"], maintenance=False, listen=False,
                            stop_grace_seconds=0.2)
    thread = threading.Thread(target=worker.run)
    thread.start()
    for _ in range(100):
        if runtime.store.reads.get(task["id"])["status"] == "running":
            break
        time.sleep(0.05)
    worker.stop("test")
    thread.join(10)
    row = runtime.store.reads.get(task["id"])
    assert row["status"] == "pending" and worker.stats.released == 1


def test_heartbeat_flags_a_task_whose_lease_was_taken(runtime: Runtime) -> None:
    task = submit(runtime.store, "echo", {"goal": "slow", "sleep": 2})
    worker = runtime.worker(["echo"], maintenance=False, listen=False, lease_seconds=30)
    thread = threading.Thread(target=worker.run)
    thread.start()
    for _ in range(100):
        if runtime.store.reads.get(task["id"])["status"] == "running":
            break
        time.sleep(0.05)
    expire_leases(runtime.store)
    runtime.store.hygiene.reap(3)
    assert worker.heartbeat_once() == 0
    worker.stop("test")
    thread.join(10)
    assert worker.stats.stale >= 1
    assert runtime.store.reads.get(task["id"])["status"] == "pending"


def test_a_lost_hook_hears_of_the_task_taken_away_and_can_abort_its_work(
        runtime: Runtime) -> None:
    task = submit(runtime.store, "async_napper", {"goal": "g", "nap": 60.0})
    AsyncNapper.now = 0
    worker = runtime.worker(["async_napper"], maintenance=False, listen=False,
                            lease_seconds=30)
    heard: list[str] = []

    def on_lost(items: list[Any]) -> None:
        heard.extend(str(i.row.id) for i in items)
        for item in items:
            item.abort("taken away")  # what a cancellation does: stop the coroutine now

    worker.leases.on_lost(on_lost)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while AsyncNapper.now < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.leases.lost() == []
        backdate_claims(runtime.store, 100_000)  # the watchdog takes it away for good
        assert runtime.store.hygiene.time_out().failed == 1
        assert worker.heartbeat_once() == 0
        assert heard == [str(task["id"])]
        deadline = time.monotonic() + 10
        # (The drop is counted before the task leaves the held set: wait for both.)
        while ((worker.stats.dropped < 1 or len(worker.held) > 0)
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert worker.stats.dropped == 1 and AsyncNapper.now == 0  # the nap was cancelled
        assert len(worker.held) == 0
    finally:
        worker.stop("test")
        thread.join(10)
    assert worker.stats.stale == 0 and worker.stats.released == 0
    assert worker.stats.claimed == 1
    assert runtime.store.reads.get(task["id"])["status"] == "failed"


def test_a_task_whose_outcome_is_being_written_is_not_reported_lost(runtime: Runtime) -> None:
    # Between the writer's commit and the task leaving the held set, the heartbeat finds
    # its token gone: that is the task's own write, not a lease taken away.
    from runtime.engine.worker.state import InFlight

    submit(runtime.store, "echo", {"goal": "g"})
    worker = runtime.worker(["echo"], maintenance=False, listen=False)
    (row,) = runtime.store.claims.claim(["echo"], 1, worker.config.worker_id, 30)
    written = RunOutcome(row.id, row.lease, "failed", error="done elsewhere")
    runtime.store.transitions.finish_running([written], worker.config.worker_id)
    heard: list[Any] = []
    worker.leases.on_lost(heard.extend)
    item = InFlight(row, "run", action=written)
    worker.held.add(item)
    worker.heartbeat_once()
    assert heard == [] and not item.lease_lost.is_set()
    item.action = None  # no outcome of its own: the token gone means the lease is lost
    worker.heartbeat_once()
    assert heard == [item] and item.lease_lost.is_set()


def test_an_aborted_sync_task_is_dropped_at_once_while_its_thread_runs_on(
        runtime: Runtime) -> None:
    # A sync agent's task is worked on through its thread's future (no coroutine):
    # aborting it cancels the future, the task is dropped and no longer held right away,
    # and the agent's result, when its thread ends, is ignored.
    task = submit(runtime.store, "echo", {"goal": "g", "sleep": 3.0})
    worker = runtime.worker(["echo"], maintenance=False, listen=False, lease_seconds=30)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while len(worker.held) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        (item,) = worker.held.items()
        assert item.job is not None and not isinstance(item.job, asyncio.Task)
        started = time.monotonic()
        item.abort("taken away")
        while worker.stats.dropped < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.stats.dropped == 1 and len(worker.held) == 0
        assert time.monotonic() - started < 2.0  # not after the 3 s nap
        assert item.lease_lost.is_set()
        wait_until(item.job.done, timeout=10, what="the agent's thread to end its nap")
    finally:
        worker.stop("test")  # a stopping worker writes every outcome it holds first
        thread.join(10)
    assert sum(worker.stats.outcomes.values()) == 0  # the nap's result was not written
    assert runtime.store.reads.get(task["id"])["status"] == "running"  # left to the reaper


def test_worker_run_with_once_drains_and_exits(runtime: Runtime) -> None:
    ids = [submit(runtime.store, "echo", {"goal": str(i)})["id"] for i in range(30)]
    worker = runtime.worker(None, once=True, sync_threads=4, batch_size=8)
    stats = worker.run()
    assert stats.stop_reason == "queue empty"
    assert all(runtime.store.reads.get(i)["status"] == "done" for i in ids)


def test_a_once_worker_judges_what_it_ran_before_it_exits(runtime: Runtime) -> None:
    # Without notifications, the worker's own write of a result that waits for the judge
    # must send its next claim to the judge's queue too. It used to wait for the 'judge'
    # notification (or a poll), so a --once worker found both queues "empty" and exited
    # with the task still judging (a browser test that drove a tree this way timed out).
    task = submit(runtime.store, "echo", {"goal": "hi"},
                  success_criteria={"rubric": {"text": "The answer says hi.", "threshold": 0}})
    worker = runtime.worker(None, once=True, maintenance=False, listen=False,
                            poll_interval_seconds=30)
    stats = worker.run()
    assert stats.stop_reason == "queue empty"
    row = runtime.store.reads.get(task["id"])
    # Judged (the offline backend scores no rubric: escalated, saying so), not left judging.
    assert row["status"] in ("done", "failed", "escalated"), (row["status"], row["error"])
    assert ("judging", row["status"]) in events(runtime.store, task["id"])


def test_task_cap_stops_the_worker(runtime: Runtime) -> None:
    for i in range(10):
        submit(runtime.store, "echo", {"goal": str(i)})
    worker = runtime.worker(["echo"], task_cap=4, maintenance=False, listen=False)
    stats = worker.run()
    assert stats.claimed == 4 and stats.stop_reason == "task cap reached"


def listening(store: Store) -> bool:
    """Whether a session of the test's database has subscribed to the task channel."""
    with store.engine.connect() as conn:
        return bool(conn.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state = 'idle' AND query LIKE :listen AND query NOT LIKE '%pg_stat%'"),
            {"listen": f"%LISTEN {TASKS_CHANNEL}%"}).scalar())


def test_worker_wakes_on_notify(runtime: Runtime) -> None:
    worker = runtime.worker(None, poll_interval_seconds=30, maintenance=False)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: listening(runtime.store), what="the worker's LISTEN")
        task = submit(runtime.store, "echo", {"goal": "wake"})
        # a 30 s poll would not have found it within 5 s
        wait_until(lambda: runtime.store.reads.get(task["id"])["status"] == "done", timeout=5.0,
                   what="the task woken by its notification to be done")
    finally:
        worker.stop("test")
        thread.join(10)


def test_a_result_the_database_refuses_fails_alone_and_the_batch_goes_on(
        runtime: Runtime) -> None:
    bad = submit(runtime.store, "nul")
    good = [submit(runtime.store, "echo", {"goal": str(i)})["id"] for i in range(3)]
    drain(runtime)
    row = runtime.store.reads.get(bad["id"])
    assert row["status"] == "failed"
    assert "could not be stored" in row["error"]
    assert all(runtime.store.reads.get(i)["status"] == "done" for i in good)


def test_a_reassignment_outside_the_org_chart_escalates_the_parent(runtime: Runtime) -> None:
    # fanout may not delegate to noop: a reassignment is a delegation, and is checked.
    root = submit(runtime.store, "fanout", {"goal": "g", "n": 1, "child": "boom",
                                            "retry_failed": True, "reassign": "noop"})
    drain(runtime)
    row = runtime.store.reads.get(root["id"])
    assert row["status"] == "escalated"
    assert row["error"].startswith("policy delegation_edges:"), row["error"]


def test_a_reassignment_inside_the_org_chart_runs_the_failed_child_again(
        runtime: Runtime) -> None:
    root = submit(runtime.store, "fanout", {"goal": "g", "n": 2, "child": "boom",
                                            "retry_failed": True, "reassign": "echo"})
    drain(runtime)
    assert runtime.store.reads.get(root["id"])["status"] == "done"
    children = runtime.store.reads.children(root["id"])
    assert [(c["to_agent"], c["status"]) for c in children] == [("echo", "done")] * 2


@pytest.mark.parametrize(("limit", "status"), [(1, "escalated"), (2, "done")])
def test_the_inline_judge_counts_the_failures_of_the_children_aggregated(
        runtime: Runtime, limit: int, status: str) -> None:
    # Two children fail; the parent's aggregate returns a result anyway, and the judge
    # (inline, in the same worker) holds it to max_child_failures.
    root = submit(runtime.store, "fanout", {"goal": "g", "n": 2, "child": "boom",
                                            "tolerate": True},
                  kill_criteria={"max_child_failures": limit})
    drain(runtime)
    row = runtime.store.reads.get(root["id"])
    assert row["status"] == status, row["error"]
    assert row["result"] == {"parts": 2, "failed": 2}
    if status == "escalated":
        assert "max_child_failures: 2 of 2 children" in row["error"]


def test_a_run_that_finds_failed_children_is_judged_against_max_child_failures(
        runtime: Runtime) -> None:
    # A task that delegated, then went back to pending (a transient error while it
    # aggregated), runs again and this time returns a result: the inline judge counts the
    # children it already has, as the judge stage would.
    store = runtime.store
    root = submit(store, "echo", {"goal": "g"}, kill_criteria={"max_child_failures": 0})
    (parent,) = store.claims.claim(["echo"], 1, "w", 30)
    store.transitions.delegate(parent.id, parent.lease, child_rows(2), "w")
    kids = store.claims.claim(["echo"], 2, "w", 30)
    store.transitions.finish_running([RunOutcome(k.id, k.lease, "failed", error="boom")
                                      for k in kids], "w")
    (again,) = store.claims.claim(["echo"], 1, "w", 30)
    assert again.id == root["id"] and again.phase == "aggregate"
    store.transitions.finish_running([RunOutcome(again.id, again.lease, "pending",
                                                 error="transient")], "w")
    drain(runtime, ["echo", "judge"])
    row = store.reads.get(root["id"])
    assert row["status"] == "escalated", row["error"]
    assert "max_child_failures: 2 of 2 children" in row["error"]


def test_async_agents_are_awaited_on_the_loop_many_at_once(runtime: Runtime) -> None:
    ids = [submit(runtime.store, "async_napper", {"goal": str(i), "nap": 1.0})["id"]
           for i in range(200)]
    AsyncNapper.peak = 0
    # Two threads for sync work: the 200 naps still overlap, because they are coroutines.
    worker = runtime.worker(["async_napper", "judge"], once=True, sync_threads=2,
                            max_in_flight=1000, batch_size=100, maintenance=False,
                            listen=False)
    stats = worker.run()
    assert stats.stop_reason == "queue empty"
    assert all(runtime.store.reads.get(i)["status"] == "done" for i in ids)
    assert AsyncNapper.peak >= 100, AsyncNapper.peak


def test_max_in_flight_bounds_what_one_worker_holds(runtime: Runtime) -> None:
    for i in range(60):
        submit(runtime.store, "async_napper", {"goal": str(i), "nap": 0.3})
    AsyncNapper.peak = 0
    worker = runtime.worker(["async_napper", "judge"], once=True, max_in_flight=7,
                            batch_size=50, maintenance=False, listen=False)
    assert worker.run().stop_reason == "queue empty"
    assert 1 < AsyncNapper.peak <= 7


def test_a_small_room_is_filled_at_the_next_poll(runtime: Runtime) -> None:
    # max_in_flight 10, batch 10: the worker claims at once when 5 or more slots are free.
    for i in range(8):
        submit(runtime.store, "async_napper", {"goal": str(i), "nap": 30.0})
    AsyncNapper.peak = 0
    worker = runtime.worker(["async_napper", "judge"], max_in_flight=10, batch_size=10,
                            poll_interval_seconds=0.2, maintenance=False,
                            stop_grace_seconds=0.2)  # the naps are handed back at the end
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while AsyncNapper.now < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert AsyncNapper.now == 8
        for i in range(5):  # room for 2: fewer than 5, so no claim on the notification
            submit(runtime.store, "async_napper", {"goal": f"late {i}", "nap": 30.0})
        deadline = time.monotonic() + 2
        while AsyncNapper.now < 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert AsyncNapper.now == 10  # the next poll filled the two free slots
    finally:
        worker.stop("test")
        thread.join(20)


def test_an_async_agent_also_runs_when_stepped_by_hand(runtime: Runtime) -> None:
    task = submit(runtime.store, "async_napper", {"goal": "g", "nap": 0})
    drain(runtime, ["async_napper", "judge"])
    assert runtime.store.reads.get(task["id"])["status"] == "done"


def test_the_docs_async_example_makes_two_calls_in_one_task(runtime: Runtime,
                                                            tmp_path: Path) -> None:
    from runtime.llm.handle import TaskLLM

    if not hasattr(TaskLLM, "acomplete"):
        pytest.skip("ctx.llm.acomplete comes with the async model layer (models branch)")
    fence = re.compile(r'^```python title="async_agents.py"\n(?P<code>.*?)^```$', re.M | re.S)
    match = fence.search(DOC.read_text(encoding="utf-8"))
    assert match, "docs/writing-agents.md lost its async example"
    namespace: dict[str, Any] = {"__name__": "docs_async_agents"}
    exec(compile(match["code"], str(DOC), "exec"), namespace)  # registers two_takes
    task = submit(runtime.store, "two_takes", {"goal": "first snow"})
    worker = runtime.worker(["two_takes", "judge"], once=True, maintenance=False,
                            listen=False)
    worker.run()
    row = runtime.store.reads.get(task["id"])
    assert row["status"] == "done", row["error"]
    assert len(runtime.store.reads.model_calls(task["id"])) == 2
