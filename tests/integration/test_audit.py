"""``orgchart audit``: a clean run passes, and each promise's check names a planted violation.

A planner with three writers (tests/fork_agents.py) runs to the end on the offline
backend; each test then plants one violation, as rows written straight into this test's
own database or as a crafted history, and asserts the checker names it with the events,
calls or operations that show it (the smallest set), and that the rest stays clean.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from runtime.audit.checker import audit
from runtime.audit.history import Recorder, load
from runtime.audit.report import Report
from runtime.cli.app import app
from runtime.config import load_settings
from runtime.store.rows import NewTask
from runtime.store.store import Store
from runtime.wiring import Runtime, build_runtime

runner = CliRunner()


@pytest.fixture
def runtime(db_url: str, store: Store) -> Runtime:
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "offline",
                                  "ORGCHART_RETRY__MAX_RETRY": "0"})
    return build_runtime(settings, ["tests.fork_agents"], store=store)


def drain(runtime: Runtime) -> None:
    worker = runtime.worker(None, maintenance=False, listen=False)
    for _ in range(60):
        if worker.run_once() == 0 and runtime.store.hygiene.sweep().ready == 0:
            return


@pytest.fixture
def tree(runtime: Runtime) -> uuid.UUID:
    """A finished tree: a planner, three writers, four paid model calls."""
    root, _ = runtime.store.tasks.submit(NewTask("fork_planner", "task", {"goal": "audit me"},
                                                 idempotency_key="audit-root"))
    drain(runtime)
    assert runtime.store.reads.get(root["id"])["status"] == "done"
    return uuid.UUID(str(root["id"]))


def run_sql(store: Store, sql: str, **params: Any) -> list[Any]:
    with store.database.transaction() as conn:
        result = conn.execute(sa.text(sql), params)
        return list(result.all()) if result.returns_rows else []


def a_writer(store: Store, root: uuid.UUID) -> uuid.UUID:
    return run_sql(store, "SELECT id FROM tasks WHERE root_id = :r AND parent_id IS NOT NULL "
                          "ORDER BY idempotency_key LIMIT 1", r=root)[0].id


def copy_call(store: Store, task: uuid.UUID, later_s: float, **changes: Any) -> int:
    """Insert a copy of the task's first paid call, ``later_s`` after it, with ``changes``."""
    sets = ", ".join(f"{k} = :{k}" for k in changes)
    row = run_sql(store, """
        WITH src AS (SELECT * FROM model_calls WHERE task_id = :t AND NOT replayed
                     ORDER BY id LIMIT 1)
        INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, model,
            prompt, response, prompt_tokens, completion_tokens, duration_seconds, cost_usd,
            phase, position, request_hash, attempt_kind, call_try, replayed, created_at)
        SELECT task_id, root_id, attempt + 1, call_index, backend, route, model, prompt,
               response, prompt_tokens, completion_tokens, 0, cost_usd, phase, position,
               request_hash, attempt_kind, call_try, false,
               created_at + make_interval(secs => :later)
        FROM src RETURNING id""", t=task, later=later_s)[0].id
    if changes:
        run_sql(store, f"UPDATE model_calls SET {sets} WHERE id = :id", id=row, **changes)
    return row


def only(report: Report, check: str) -> Any:
    """The one violation of ``check``; no other check may have found anything."""
    assert [v.check for v in report.violations] == [check], report.text()
    return report.violations[0]


# ---------------------------------------------------------------------- clean
def test_a_clean_run_passes_every_check(runtime: Runtime, tree: uuid.UUID,
                                        tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "history.jsonl")
    with rec.operation("submit", {"idempotency_key": "audit-root"}) as told:
        told["id"] = str(tree)
    report = audit(runtime.store, history=rec.path)
    assert report.ok, report.text()
    assert report.checked["trees"] == 1 and report.checked["tasks"] == 4
    assert report.checked["events"] >= 4 * 3 and report.checked["calls"] >= 4
    assert report.checked["operations"] == 1


def test_audit_reads_in_small_batches_and_pages(runtime: Runtime, tree: uuid.UUID) -> None:
    other, _ = runtime.store.tasks.submit(NewTask("fork_planner", "task", {"goal": "second"}))
    drain(runtime)
    report = audit(runtime.store, batch=1, page=2)
    assert report.ok, report.text()
    assert report.checked["trees"] == 2 and report.checked["tasks"] == 8
    assert audit(runtime.store, roots=[other["id"]]).checked["trees"] == 1


# ---------------------------------------------------------------------- 1. submits
def test_an_acknowledged_submit_without_its_root_is_named(runtime: Runtime, tree: uuid.UUID,
                                                          tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "history.jsonl")
    lost = uuid.uuid4()
    with rec.operation("submit", {"idempotency_key": "lost-key"}) as told:
        told["id"] = str(lost)
    v = only(audit(runtime.store, history=rec.path), "submits")
    assert v.subject == str(lost) and "has no task" in v.message
    assert [e["op"] for e in v.evidence] == ["submit"]


def test_a_refused_submit_that_left_a_root_is_named(runtime: Runtime, tree: uuid.UUID,
                                                    tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "history.jsonl")
    with rec.operation("submit", {"idempotency_key": "audit-root"}) as told:
        told.update(outcome="fail", status=409)
    v = only(audit(runtime.store, history=rec.path), "submits")
    assert "refused submit left a root" in v.message
    assert v.evidence[1] == {"root": tree}


# ---------------------------------------------------------------------- 2. paths
def test_an_event_out_of_order_is_named(runtime: Runtime, tree: uuid.UUID) -> None:
    writer = a_writer(runtime.store, tree)
    run_sql(runtime.store, "INSERT INTO task_events (task_id, from_status, to_status, worker, "
                           "detail) VALUES (:t, 'pending', 'running', 'w-x', 'claimed for run')",
            t=writer)
    report = audit(runtime.store)
    assert {v.check for v in report.violations} == {"paths"}, report.text()
    starts = [v for v in report.violations if "event starts at" in v.message]
    assert len(starts) == 1 and starts[0].subject == str(writer)
    assert [e["to"] for e in starts[0].evidence] == ["done", "running"]


def test_fan_in_before_a_child_ended_is_named(runtime: Runtime, tree: uuid.UUID) -> None:
    writer = a_writer(runtime.store, tree)
    # The writer's outcome now comes after its parent's fan-in (its event ids are moved).
    run_sql(runtime.store, "UPDATE task_events SET id = id + 100000 WHERE task_id = :t "
                           "AND to_status IN ('done', 'judging')", t=writer)
    v = only(audit(runtime.store), "paths")
    assert v.subject == str(tree) and "fan-in before a child was terminal" in v.message
    assert [e["to"] for e in v.evidence] == ["running", "ready_to_aggregate"]


# ---------------------------------------------------------------------- 3. steering
def test_a_call_started_after_a_cancel_is_named(runtime: Runtime) -> None:
    root, _ = runtime.store.tasks.submit(NewTask("fork_planner", "task", {"goal": "cancel me"}))
    runtime.store.steering.cancel(root["id"], actor="test")
    run_sql(runtime.store, """
        INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, model,
                                 prompt, response, duration_seconds, created_at)
        VALUES (:t, :t, 1, 0, 'offline', 'local', 'm', 'p', 'r', 0.1,
                now() + interval '5 seconds')""", t=root["id"])
    report = audit(runtime.store)
    v = next(v for v in report.violations if v.check == "steering")
    assert v.message == "model call started after its cancel"
    assert v.evidence[0]["to"] == "cancelled" and "call" in v.evidence[1]


def test_a_claim_during_a_pause_is_named(runtime: Runtime, tmp_path: Path) -> None:
    root, _ = runtime.store.tasks.submit(NewTask("fork_planner", "task", {"goal": "pause me"}))
    rec = Recorder(tmp_path / "history.jsonl")
    with rec.operation("pause", {"root": str(root["id"])}):
        runtime.store.steering.pause(root["id"], actor="test")
    time.sleep(0.05)
    with rec.operation("resume", {"root": str(root["id"])}):
        runtime.store.steering.resume(root["id"], actor="test")
    # A claim inside the pause's window, as a broken claim would have written it.
    run_sql(runtime.store, "UPDATE task_events SET at = now() + interval '0.02 seconds' "
                           "WHERE task_id = :t", t=root["id"])
    run_sql(runtime.store, "INSERT INTO task_events (task_id, from_status, to_status, worker, "
                           "detail, at) VALUES (:t, 'pending', 'running', 'w-x', "
                           "'claimed for run, delivery 1', to_timestamp(:at))",
            t=root["id"], at=load(rec.path).of("pause")[0].completed + 0.03)
    report = audit(runtime.store, history=rec.path, slack=0.0)
    steering = [v for v in report.violations if v.check == "steering"]
    assert [v.message for v in steering] == ["claimed after its tree was paused"], report.text()
    assert steering[0].evidence[0]["op"] == "pause"


def test_a_claim_after_an_acknowledged_cancel_is_named(runtime: Runtime,
                                                       tmp_path: Path) -> None:
    root, _ = runtime.store.tasks.submit(NewTask("fork_planner", "task", {"goal": "cancel me"}))
    rec = Recorder(tmp_path / "history.jsonl")
    with rec.operation("cancel", {"task": str(root["id"])}):
        pass  # the client was told ok, but nothing was cancelled
    report = audit(runtime.store, history=rec.path)
    v = only(report, "steering")
    assert "cancel told ok but the task is still 'pending'" in v.message


# ---------------------------------------------------------------------- 4. duplicates
def test_a_call_paid_twice_outside_a_fault_is_named(runtime: Runtime, tree: uuid.UUID,
                                                    tmp_path: Path) -> None:
    writer = a_writer(runtime.store, tree)
    # The first call ran 2 s; the copy was sent 1 s before the first answer was recorded.
    run_sql(runtime.store, "UPDATE model_calls SET duration_seconds = 2 WHERE id = "
                           "(SELECT min(id) FROM model_calls WHERE task_id = :t)", t=writer)
    again = copy_call(runtime.store, writer, 0.001, duration_seconds=1.0)
    v = only(audit(runtime.store, slack=0.0), "duplicates")
    assert v.subject == str(writer) and "paid twice outside any fault window" in v.message
    assert [e["call"] for e in v.evidence][1] == again
    # The same copy, with a kill recorded while the first call was in flight: allowed.
    rec = Recorder(tmp_path / "history.jsonl")
    first = run_sql(runtime.store, "SELECT extract(epoch FROM created_at) AS at "
                                   "FROM model_calls WHERE task_id = :t ORDER BY id LIMIT 1",
                    t=writer)[0].at
    rec.fault("kill", "worker-0", start=float(first) - 1.5, end=float(first) - 1.5)
    report = audit(runtime.store, history=rec.path, slack=0.0)
    assert not report.of("duplicates"), report.text()
    assert [f["call"] for f in report.in_flight] == [again]


def test_a_call_sent_again_after_its_answer_was_durable_is_named_across_a_fault(
        runtime: Runtime, tree: uuid.UUID, tmp_path: Path) -> None:
    writer = a_writer(runtime.store, tree)
    first = run_sql(runtime.store, "SELECT extract(epoch FROM created_at) AS at "
                                   "FROM model_calls WHERE task_id = :t AND NOT replayed "
                                   "ORDER BY id LIMIT 1", t=writer)[0].at
    # Sent 5 s after the first answer was committed, a kill in between: the answer was
    # on record, so the next delivery had to replay it, whatever the fault. (The
    # writer's delivery is stretched to hold the copy: only the duplicate is wrong.)
    run_sql(runtime.store, "UPDATE task_events SET at = at + interval '10 seconds' "
                           "WHERE task_id = :t AND from_status = 'running'", t=writer)
    again = copy_call(runtime.store, writer, 5.5, duration_seconds=0.5)
    rec = Recorder(tmp_path / "history.jsonl")
    rec.fault("kill", "worker-0", start=float(first) + 2, end=float(first) + 2)
    v = only(audit(runtime.store, history=rec.path, slack=1.0), "duplicates")
    assert v.subject == str(writer)
    assert v.message == "model call sent again after its answer was durable"
    assert [e["call"] for e in v.evidence][1] == again
    # A replay of the record (a row marked replayed) is what should have happened: clean.
    run_sql(runtime.store, "UPDATE model_calls SET replayed = true WHERE id = :id", id=again)
    assert audit(runtime.store, history=rec.path, slack=1.0).ok


def test_a_request_the_model_server_answered_twice_outside_a_fault_is_named(
        store: Store, tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "history.jsonl")
    rec.request("model", "abc123", 100.0)
    rec.request("model", "abc123", 105.0)
    rec.request("model", "other", 101.0)
    v = only(audit(store, history=rec.path, slack=0.0), "duplicates")
    assert "answered one request twice outside any fault window" in v.message
    assert [e["at"] for e in v.evidence] == [100.0, 105.0]
    rec.fault("kill", "worker", start=103.0, end=103.0)
    report = audit(store, history=rec.path, slack=0.0)
    assert report.ok and len(report.in_flight) == 1, report.text()


def test_a_step_run_twice_outside_a_fault_is_named(runtime: Runtime, tree: uuid.UUID) -> None:
    writer = a_writer(runtime.store, tree)
    # Inside the writer's lease: a third and two thirds of the way from its claim to its end.
    run_sql(runtime.store, """
        WITH lease AS (
            SELECT at AS c, lead(at) OVER (ORDER BY id) AS n, to_status FROM task_events
            WHERE task_id = :t)
        INSERT INTO task_steps (task_id, root_id, phase, position, name, status, args_hash,
                                idempotency_key, attempt, starts, started_at, finished_at)
        SELECT t.id, t.root_id, 'run', '0', 'send_mail', 'finished', 'h', 'k', 1, 2,
               l.c + (l.n - l.c) / 3, l.c + (l.n - l.c) * 2 / 3
        FROM tasks t, lease l WHERE t.id = :t AND l.to_status = 'running'""", t=writer)
    v = only(audit(runtime.store, slack=0.0), "duplicates")
    assert "step started 2 times" in v.message and v.evidence[0]["name"] == "send_mail"


# ---------------------------------------------------------------------- 5. budgets
def test_a_charge_past_the_budget_is_named(runtime: Runtime, tree: uuid.UUID) -> None:
    writer = a_writer(runtime.store, tree)
    run_sql(runtime.store, "UPDATE tasks SET budget_tokens = 1 WHERE id = :t", t=writer)
    report = audit(runtime.store)
    v = next(v for v in report.of("budgets") if v.subject == str(writer))
    assert "past its budget" in v.message and v.evidence[0]["budget_tokens"] == 1
    assert "call" in v.evidence[1]


def test_a_carve_past_the_parents_remainder_is_named(runtime: Runtime, tree: uuid.UUID) -> None:
    run_sql(runtime.store, "UPDATE tasks SET budget_usd = 0.5 WHERE id = :t", t=tree)
    v = only(audit(runtime.store), "budgets")
    assert v.subject == str(tree) and "children carved" in v.message
    assert len(v.evidence) == 2 + 3  # the budget, the spend before, the three children


# ---------------------------------------------------------------------- 6. answers
def test_an_acknowledged_answer_never_applied_is_named(runtime: Runtime,
                                                       tmp_path: Path) -> None:
    question, _ = runtime.store.tasks.submit(NewTask("human", "question", {"question": "ok?"}))
    rec = Recorder(tmp_path / "history.jsonl")
    with rec.operation("answer", {"task": str(question["id"]), "answer": "yes"}):
        pass  # told ok; nothing was written
    v = only(audit(runtime.store, history=rec.path), "answers")
    assert v.message == "answer told ok was never applied"


def test_a_refused_answer_that_changed_something_is_named(runtime: Runtime,
                                                          tmp_path: Path) -> None:
    question, _ = runtime.store.tasks.submit(NewTask("human", "question", {"question": "ok?"}))
    rec = Recorder(tmp_path / "history.jsonl")
    with rec.operation("answer", {"task": str(question["id"]), "answer": "yes"}) as told:
        runtime.store.steering.answer(question["id"], "yes", actor="test")
        told.update(outcome="fail", status=409)
    v = only(audit(runtime.store, history=rec.path), "answers")
    assert "applied 1 time(s) but 0 client(s) were told ok" in v.message
    assert [e.get("op", "event") for e in v.evidence] == ["answer", "event"]


# ---------------------------------------------------------------------- 7. fencing
def test_every_transition_under_a_lease_carries_its_token(runtime: Runtime,
                                                         tree: uuid.UUID) -> None:
    rows = run_sql(runtime.store, "SELECT e.from_status, e.to_status, e.lease_token "
                                  "FROM task_events e JOIN tasks t ON t.id = e.task_id "
                                  "WHERE t.root_id = :r ORDER BY e.id", r=tree)
    leased = [r for r in rows if "running" in (r.from_status, r.to_status)
              or r.from_status == "judging"]
    assert leased and all(r.lease_token is not None for r in leased), rows
    unleased = [r for r in rows if r not in leased]
    assert unleased and all(r.lease_token is None for r in unleased), rows


def test_an_outcome_under_another_delivery_token_is_named(runtime: Runtime,
                                                          tree: uuid.UUID) -> None:
    writer = a_writer(runtime.store, tree)
    # The same worker, another delivery: only the token tells them apart.
    run_sql(runtime.store, "UPDATE task_events SET lease_token = gen_random_uuid() "
                           "WHERE task_id = :t AND from_status = 'running'", t=writer)
    v = only(audit(runtime.store), "fencing")
    assert "outcome written under token" in v.message
    assert "while the task's last claim holds" in v.message
    assert [e["to"] for e in v.evidence] == ["running", v.evidence[1]["to"]]
    assert v.evidence[0]["worker"] == v.evidence[1]["worker"]


def test_an_outcome_by_a_worker_without_the_lease_is_named_on_untokened_events(
        runtime: Runtime, tree: uuid.UUID) -> None:
    writer = a_writer(runtime.store, tree)
    # Events written before they carried tokens: the workers are compared.
    run_sql(runtime.store, "UPDATE task_events SET lease_token = NULL WHERE task_id = :t",
            t=writer)
    assert audit(runtime.store).ok
    run_sql(runtime.store, "UPDATE task_events SET worker = 'w-late' WHERE task_id = :t "
                           "AND from_status = 'running'", t=writer)
    v = only(audit(runtime.store), "fencing")
    assert "written by 'w-late' while the lease was held by" in v.message
    assert [e["to"] for e in v.evidence] == ["running", v.evidence[1]["to"]]


def test_a_charge_outside_every_lease_is_named(runtime: Runtime, tree: uuid.UUID) -> None:
    writer = a_writer(runtime.store, tree)
    copy_call(runtime.store, writer, 60.0, position="late")
    v = only(audit(runtime.store), "fencing")
    assert v.message == "model call charged outside any lease of its task"


# ---------------------------------------------------------------------- the command
def test_the_command_exits_0_clean_and_1_with_a_violation(runtime: Runtime, tree: uuid.UUID,
                                                          orgchart_env: dict[str, str]) -> None:
    clean = runner.invoke(app, ["audit", "--json"])
    assert clean.exit_code == 0, clean.stdout
    assert json.loads(clean.stdout)["ok"] is True
    run_sql(runtime.store, "UPDATE task_events SET lease_token = gen_random_uuid() "
                           "WHERE task_id = :t AND from_status = 'running'",
            t=a_writer(runtime.store, tree))
    bad = runner.invoke(app, ["audit", "--root", str(tree)])
    assert bad.exit_code == 1
    assert "VIOLATION [fencing]" in bad.stdout and "1 violation(s)" in bad.stdout
    assert runner.invoke(app, ["audit", "--since", "yesterday"]).exit_code == 2
