"""``orgchart fire``: lock, daily cap, hygiene first, capped workers, the rollup.

The plan and the caps are tested as pure functions; the fire itself runs real
``orgchart worker`` subprocesses against the test database, with the ``echo``,
``fanout`` and ``boom`` agents of ``tests.support_agents`` (no model needed).
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from runtime.config import Settings, load_settings
from runtime.errors import BadInput
from runtime.fleet.decider import (
    Assignment,
    Limits,
    Plan,
    RuleBasedDecider,
    Snapshot,
    load_decider,
    share_workers,
)
from runtime.fleet.orchestrator import FIRE_LOCK_KEY, FireConfig, Orchestrator
from runtime.fleet.rollup import Hygiene, WorkerRun, build_rollup
from runtime.store.store import Store
from tests.factories import expire_leases, submit

MODULE = "tests.support_agents"
REPO_ROOT = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)


# ---------------------------------------------------------------------- helpers
def cli_env(orgchart_env: dict[str, str]) -> dict[str, str]:
    env = dict(orgchart_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def orgchart(env: dict[str, str], *args: str) -> list[str]:
    return [sys.executable, "-m", "runtime.cli.app", *args]


def run_cli(env: dict[str, str], *args: str,
            timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(orgchart(env, *args), env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)


def settings_for(env: dict[str, str]) -> Settings:
    return load_settings(env=env)


def orchestrator(store: Store, env: dict[str, str], **overrides: Any) -> Orchestrator:
    settings = settings_for(env)
    config = FireConfig.from_settings(settings, agents_modules=(MODULE,), env=cli_env(env),
                                      **overrides)
    return Orchestrator(store, settings, config)


def scalar(store: Store, sql: str, **params: Any) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def fires(store: Store) -> int:
    return int(scalar(store, "SELECT count(*) FROM fires"))


def statuses(store: Store) -> Counter[str]:
    with store.engine.connect() as conn:
        return Counter({r.status: r.n for r in conn.execute(
            sa.text("SELECT status, count(*) AS n FROM tasks GROUP BY status"))})


def queue(*rows: tuple[str, int, int, dt.datetime]) -> list[dict[str, Any]]:
    return [{"to_agent": a, "n": n, "top_priority": p, "oldest": o} for a, n, p, o in rows]


# ---------------------------------------------------------------------- the plan
def test_workers_are_shared_in_proportion_to_queue_size() -> None:
    assert share_workers([90, 10], 4, 10) == [3, 1]
    assert share_workers([30, 30], 4, 10) == [2, 2]


def test_every_mode_gets_a_worker_and_the_total_stays_within_max_workers() -> None:
    counts = share_workers([1000, 1, 1], 4, 10)
    assert counts == [2, 1, 1] and sum(counts) == 4
    assert share_workers([5, 5, 5, 5, 5], 2, 10) == [1, 1, 1, 1, 1]  # started as slots free


def test_a_small_backlog_gets_no_more_workers_than_its_task_cap_needs() -> None:
    assert share_workers([6], 8, 200) == [1]
    assert share_workers([6], 8, 2) == [3]


def test_plan_drains_escalation_adjacent_and_stale_work_first_then_by_priority() -> None:
    limits = Limits(max_workers=8, task_cap=5, wall_clock_seconds=30)
    snap = Snapshot.from_rows(
        queue(("urgent", 3, 1, NOW - dt.timedelta(minutes=1)),
              ("routine", 3, 5, NOW - dt.timedelta(minutes=2)),
              ("stale", 3, 9, NOW - dt.timedelta(hours=5)),
              ("flagged", 3, 9, NOW - dt.timedelta(minutes=3)),
              ("judge", 3, 5, NOW - dt.timedelta(minutes=1)),
              ("later", 3, 5, NOW)),
        [{"id": uuid.uuid4(), "to_agent": "scout", "from_agent": "flagged", "error": "x",
          "escalated_at": NOW}],
        [{"status": "pending", "n": 12}], limits, taken_at=NOW)
    plan = RuleBasedDecider().plan(snap)
    # stale and escalation-adjacent first, oldest first; then priority, then age
    assert plan.modes == ["stale", "flagged", "urgent", "routine", "judge", "later"]
    assert plan.assignments[0].reason == "stale work"
    assert plan.assignments[1].reason == "next to an open escalation"
    assert all(a.task_cap == 5 and a.wall_clock_seconds == 30 for a in plan.assignments)
    assert plan.workers <= limits.max_workers


def test_plan_is_empty_when_nothing_is_claimable() -> None:
    snap = Snapshot.from_rows([], [], [], Limits(2, 10, 60))
    assert RuleBasedDecider().plan(snap) == Plan()


def test_queue_rows_for_the_same_mode_are_merged() -> None:
    snap = Snapshot.from_rows(queue(("judge", 2, 5, NOW), ("judge", 3, 1, NOW)), [], [],
                              Limits(2, 10, 60))
    assert [(q.mode, q.queued, q.top_priority) for q in snap.queue] == [("judge", 5, 1)]


def test_a_decider_name_that_cannot_be_loaded_is_a_clear_error() -> None:
    with pytest.raises(BadInput, match="module:Class"):
        load_decider("runtime.fleet.decider.RuleBasedDecider")
    with pytest.raises(BadInput, match="cannot import 'no_such_module'"):
        load_decider("no_such_module:Decider")
    with pytest.raises(BadInput, match="has no 'Nope'"):
        load_decider("runtime.fleet.decider:Nope")
    with pytest.raises(BadInput, match="no plan"):
        load_decider("collections:OrderedDict")


def test_fire_config_rejects_caps_that_make_no_sense() -> None:
    with pytest.raises(BadInput, match="'max_workers': Input should be greater than or equal"):
        FireConfig.from_settings(Settings(), max_workers=0)
    with pytest.raises(BadInput, match="'wall_clock_seconds': Input should be greater than 0"):
        FireConfig.from_settings(Settings(), wall_clock_seconds=-1)
    with pytest.raises(ValueError, match="replan_interval_seconds must be positive"):
        FireConfig(replan_interval_seconds=0)


def test_the_kill_grace_outlasts_the_workers_stop_grace() -> None:
    assert FireConfig.from_settings(Settings()).kill_grace_seconds == 15.0
    settings = Settings.model_validate({"worker": {"stop_grace_seconds": 60}})
    assert FireConfig.from_settings(settings).kill_grace_seconds == 65.0
    assert FireConfig.from_settings(settings, kill_grace_seconds=1).kill_grace_seconds == 1


def test_each_worker_gets_one_mode_a_task_cap_a_wall_clock_and_the_agent_modules(
        store: Store) -> None:
    orch = Orchestrator(store, Settings(), FireConfig(agents_modules=("a.b", "c")))
    cmd = orch.worker_command("echo", 7, 12.5)
    assert cmd[1:] == ["-m", "runtime.cli", "worker", "--agents", "echo", "--task-cap", "7",
                       "--wall-clock", "12.5", "--once", "--json",
                       "--agents-module", "a.b", "--agents-module", "c"]


class Greedy:
    """A decider that asks for more than the caps allow (the fire must clamp it)."""

    def plan(self, snapshot: Snapshot) -> Plan:
        return Plan(tuple(Assignment(q.mode, 50, 10_000, 10_000.0, q.queued)
                          for q in snapshot.queue))


def test_a_custom_decider_is_clamped_to_the_fires_caps_and_known_agents(
        store: Store, orgchart_env: dict[str, str]) -> None:
    submit(store, "echo")
    submit(store, "ghost")  # no module registers it
    orch = orchestrator(store, orgchart_env, decider=f"{Greedy.__module__}:Greedy",
                        max_workers=3, task_cap=4, wall_clock_seconds=20)
    plan, unknown = orch.decide()
    assert [a.as_dict() for a in plan.assignments] == [
        {"mode": "echo", "workers": 3, "task_cap": 4, "wall_clock_seconds": 20,
         "queued": 1, "reason": ""}]
    assert unknown == {"ghost": 1}


# ---------------------------------------------------------------------- the rollup
def event(worker: str, src: str | None, dst: str, n: int, released: bool = False,
          aggregate: bool = False) -> dict[str, Any]:
    return {"worker": worker, "from_status": src, "to_status": dst, "n": n,
            "released": released, "aggregate": aggregate}


def test_the_rollup_counts_from_events_and_flags_workers_whose_report_disagrees() -> None:
    runs = [
        WorkerRun("echo", 11, "h:11:", 5, 10.0, exit_code=0, stats={
            "worker": "h:11:ab", "claimed": 4, "outcomes": {"judging": 3}, "delegated": 0,
            "released": 0, "stale": 1}),
        WorkerRun("judge", 12, "h:12:", 5, 10.0, signal="SIGKILL", seconds=16.0),
        WorkerRun("fanout", 13, "h:13:", 5, 10.0, exit_code=0, stats={
            "worker": "h:13:ef", "claimed": 2, "outcomes": {}, "delegated": 1,
            "released": 1}),
    ]
    rows = [event("h:11:ab", "pending", "running", 4),        # claims are not outcomes
            event("h:11:ab", "running", "judging", 2),        # the report said 3
            event("h:11:ab", "running", "pending", 1),        # a transient retry
            event("h:11:ab", "waiting", "ready_to_aggregate", 1),  # fan-in flip
            event("h:12:cd", "judging", "done", 2),
            event("h:13:ef", "running", "waiting", 1),
            event("h:13:ef", "running", "waiting", 1, aggregate=True),
            event("h:13:ef", "running", "ready_to_aggregate", 1, released=True),
            event("h:111:zz", "running", "judging", 9)]       # another process: not ours
    escalated_at = NOW - dt.timedelta(hours=3)
    rollup = build_rollup(
        fire_id=3, runs=runs, hygiene=Hygiene(released=2), event_rows=rows,
        failures=[{"status": "failed", "agent": "boom", "error": "kaboom", "n": 2}],
        escalations=[{"id": "t-1", "to_agent": "ceo", "error": "over budget",
                      "escalated_at": escalated_at}, {"id": "t-2", "to_agent": "x"}],
        left_queued={"echo": 1}, plans=4, seconds=12.34, now=NOW)
    stats = rollup.stats
    assert stats["by_mode"] == {
        "echo": {"drained": 2, "judging": 2, "pending": 1},
        "judge": {"drained": 2, "done": 2},
        "fanout": {"drained": 2, "delegated": 1, "retried": 1, "released": 1}}
    assert stats["drained"] == 6
    assert stats["anomalies"] == [
        "worker 11 (echo) reported judging 3 but task_events recorded judging 2, retry later 1",
        "worker 12 (judge) outlived its wall clock of 10s: SIGKILL after 16.0s",
        "hygiene before the fan-out: released 2 stranded task(s), poisoned 0, timed out 0, "
        "swept 0 waiting parent(s)",
        "1 stale write(s) ignored (lease taken away)"]
    assert rollup.text.splitlines() == [
        "fire 3: 6 task(s) drained by 3 worker(s) in 12.3s (4 plan(s))",
        "drained per mode:",
        "  echo: 2 (judging 2, retry later 1)",
        "  judge: 2 (done 2)",
        "  fanout: 2 (delegated 1, retried children 1, released 1)",
        "failures and escalations:",
        "  failed x2 (boom): kaboom",
        "anomalies:",
        *[f"  {a}" for a in stats["anomalies"]],
        "left queued: echo 1",
        "needs a person: task t-1 (ceo) escalated 3.0h ago: over budget (+1 more open); "
        "orgchart resolve t-1 --retry|--done|--fail"]


# ---------------------------------------------------------------------- fires
def test_two_fires_started_at_once_run_exactly_one(
        store: Store, orgchart_env: dict[str, str]) -> None:
    for i in range(4):  # one batch of a worker's 4 threads: the winner holds the lock >= 1 s
        submit(store, "echo", {"goal": f"g{i}", "sleep": 1.0})
    env = cli_env(orgchart_env)
    args = ("fire", "--agents-module", MODULE)
    procs = [subprocess.Popen(orgchart(env, *args), env=env, cwd=REPO_ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    said = [out for out, _ in outputs]
    assert sum("another fire is running" in s for s in said) == 1, said
    assert sum("drained per mode" in s for s in said) == 1, said
    assert fires(store) == 1
    assert statuses(store) == {"done": 4}


def test_a_fire_that_finds_the_lock_taken_does_nothing(
        store: Store, orgchart_env: dict[str, str]) -> None:
    submit(store, "echo")
    with store.fires.lock(FIRE_LOCK_KEY) as locked:
        assert locked
        result = orchestrator(store, orgchart_env).run_once()
    assert result.status == "locked" and result.message.startswith("another fire is running")
    assert fires(store) == 0 and statuses(store) == {"pending": 1}


def test_the_daily_cap_refuses_a_fire_and_does_nothing(
        store: Store, orgchart_env: dict[str, str]) -> None:
    submit(store, "echo")
    with store.database.transaction() as conn:  # six fires today, one yesterday
        conn.execute(sa.text("INSERT INTO fires (started_at, finished_at) "
                             "SELECT now() - make_interval(hours => h), now() "
                             "FROM generate_series(1, 6) h"))
        conn.execute(sa.text("INSERT INTO fires (started_at) VALUES (now() - interval '25h')"))
    done = run_cli(cli_env(orgchart_env), "fire", "--agents-module", MODULE)
    assert done.returncode == 0, done.stderr
    assert "daily cap reached: 6 fire(s) in the last 24 h, daily_cap = 6" in done.stdout
    assert fires(store) == 7 and statuses(store) == {"pending": 1}


def test_dry_run_prints_the_plan_and_runs_nothing(
        store: Store, orgchart_env: dict[str, str]) -> None:
    task = submit(store, "echo")
    store.claims.claim(["echo"], 1, "dead:1:x", 30)
    expire_leases(store)
    submit(store, "fanout")
    done = run_cli(cli_env(orgchart_env), "fire", "--dry-run", "--agents-module", MODULE)
    assert done.returncode == 0, done.stderr
    assert "fanout: 1 worker for 1 queued" in done.stdout
    assert fires(store) == 0
    assert store.reads.get(task["id"])["status"] == "running"  # no hygiene either


def test_bad_caps_on_the_command_line_exit_2_naming_the_option(
        orgchart_env: dict[str, str]) -> None:
    done = run_cli(cli_env(orgchart_env), "fire", "--max-workers", "0")
    assert done.returncode == 2
    assert "bad value for 'max_workers'" in done.stderr


def test_hygiene_runs_before_the_fan_out_and_the_stranded_task_is_drained(
        store: Store, orgchart_env: dict[str, str]) -> None:
    task = submit(store, "echo", {"goal": "left by a SIGKILLed worker"})
    claimed = store.claims.claim(["echo"], 1, "dead-host:4242:abcdef", 30)
    assert claimed[0]["status"] == "running"
    expire_leases(store, minutes=10)
    result = orchestrator(store, orgchart_env).run_once()
    assert result.status == "ran"
    assert result.stats["hygiene"]["released"] == 1
    row = store.reads.get(task["id"])
    assert row["status"] == "done"
    history = [(e["from_status"], e["to_status"], e["worker"])
               for e in store.reads.events(task["id"])]
    assert history[2] == ("running", "pending", "reaper")  # released before any worker claimed
    assert history[3][:2] == ("pending", "running")
    assert "hygiene before the fan-out: released 1 stranded task(s)" in result.rollup


def test_workers_respect_the_task_cap_and_the_fire_keeps_going_until_the_queue_is_empty(
        store: Store, orgchart_env: dict[str, str]) -> None:
    for i in range(2):
        submit(store, "echo", {"goal": f"g{i}"})
    result = orchestrator(store, orgchart_env, task_cap=1, max_workers=2).run_once()
    workers = result.stats["workers"]
    assert all(w["task_cap"] == 1 and w["stats"]["claimed"] <= 1 for w in workers), workers
    echo = [w for w in workers if w["mode"] == "echo"]
    assert len(echo) == 2 and sum(w["stats"]["claimed"] for w in echo) == 2
    assert [w["stats"]["stop_reason"] for w in echo] == ["task cap reached"] * 2
    # The judge stage had nothing to do when the fire began: it was planned after a re-read.
    assert any(w["mode"] == "judge" for w in workers) and result.stats["plans"] >= 2
    assert statuses(store) == {"done": 2}
    assert result.stats["by_mode"]["echo"] == {"drained": 2, "judging": 2}
    assert result.stats["left_queued"] == {}


def test_a_worker_that_outlives_its_wall_clock_is_killed_and_reported(
        store: Store, orgchart_env: dict[str, str]) -> None:
    task = submit(store, "echo", {"goal": "stuck", "sleep": 60})
    result = orchestrator(store, orgchart_env, wall_clock_seconds=2, term_slack_seconds=0.5,
                          kill_grace_seconds=1.0).run_once()
    (worker,) = result.stats["workers"]
    assert worker["signal"] in ("SIGTERM", "SIGKILL") and worker["stats"] is None
    assert worker["wall_clock_seconds"] <= 2
    assert "outlived its wall clock of 2s" in result.rollup
    row = store.reads.get(task["id"])
    if row["status"] == "running":  # killed mid-task: its lease expires, a reaper returns it
        assert row["lease_owner"].startswith(f"{socket.gethostname()}:{worker['pid']}:")
    else:  # on a loaded machine the worker may be killed before it claimed anything
        assert row["status"] == "pending"
    assert store.fires.last()["finished_at"] is not None


def test_the_rollup_counts_equal_what_task_events_recorded(
        store: Store, orgchart_env: dict[str, str]) -> None:
    for i in range(2):
        submit(store, "echo", {"goal": f"g{i}"})
    bad = submit(store, "echo", {"goal": "write to bob@example.com"})  # policy: escalated
    submit(store, "fanout", {"goal": "two parts", "n": 2})
    submit(store, "boom")
    before = int(scalar(store, "SELECT COALESCE(max(id), 0) FROM task_events"))
    result = orchestrator(store, orgchart_env, max_workers=3).run_once()
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT t.to_agent, e.from_status, e.to_status, count(*) AS n "
            "FROM task_events e JOIN tasks t ON t.id = e.task_id "
            "WHERE e.id > :before AND e.worker NOT IN ('reaper', 'watchdog', 'sweeper') "
            "AND e.from_status IN ('running', 'judging') "
            "GROUP BY 1, 2, 3"), {"before": before}).all()
    recorded: dict[str, Counter[str]] = {}
    for agent, src, dst, n in rows:
        mode = "judge" if src == "judging" else agent
        kind = "delegated" if dst == "waiting" else dst
        recorded.setdefault(mode, Counter())[kind] += n
    by_mode = {m: Counter({k: v for k, v in t.items() if k != "drained"})
               for m, t in result.stats["by_mode"].items()}
    # Aggregates that retried children would show as 'retried'; none here.
    assert by_mode == recorded
    assert recorded == {"echo": {"judging": 4, "escalated": 1}, "judge": {"done": 5},
                        "fanout": {"delegated": 1, "judging": 1}, "boom": {"failed": 1}}
    assert result.stats["drained"] == sum(sum(c.values()) for c in recorded.values())
    for mode, counts in recorded.items():
        assert f"  {mode}: {sum(counts.values())}" in result.rollup
    assert not [a for a in result.stats["anomalies"] if "reported" in a]  # stats == events
    failures = {(f["status"], f["agent"]): f for f in result.stats["failures"]}
    assert failures[("failed", "boom")]["count"] == 1
    assert "kaboom" in failures[("failed", "boom")]["error"]
    assert "forbidden_output" in failures[("escalated", "echo")]["error"]
    person = result.stats["needs_a_person"]
    assert person["task_id"] == str(bad["id"]) and person["open"] == 1
    assert f"needs a person: task {bad['id']} (echo) escalated" in result.rollup
    fire = store.fires.last()
    assert fire["rollup"] == result.rollup and fire["stats"]["drained"] == result.stats["drained"]
    assert fire["plan"]["first"]["assignments"]


def test_a_fire_with_an_empty_queue_records_a_quiet_note(
        store: Store, orgchart_env: dict[str, str]) -> None:
    result = orchestrator(store, orgchart_env).run_once()
    assert result.status == "ran" and result.stats["workers"] == []
    assert "drained per mode: nothing to drain" in result.rollup
    assert "needs a person: nothing" in result.rollup
    assert fires(store) == 1


def _fire_until_running(store: Store, orch: Orchestrator,
                        task_id: Any) -> tuple[threading.Thread, list[Any]]:
    """Start a fire in a thread; return once its worker runs ``task_id`` (or after 60 s)."""
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(orch.run_once()))
    thread.start()
    deadline = time.monotonic() + 60
    while store.reads.get(task_id)["status"] != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    return thread, results


def test_a_stopped_fire_terminates_its_workers_and_still_writes_its_note(
        store: Store, orgchart_env: dict[str, str]) -> None:
    task = submit(store, "echo", {"goal": "slow", "sleep": 60})
    orch = orchestrator(store, orgchart_env, kill_grace_seconds=1.0)
    thread, results = _fire_until_running(store, orch, task["id"])
    orch.stop("signal SIGTERM")
    thread.join(timeout=60)
    (result,) = results
    (worker,) = result.stats["workers"]
    assert worker["stopped_by_fire"] and worker["signal"] in ("SIGTERM", "SIGKILL")
    assert "fire stopped early: signal SIGTERM" in result.rollup
    assert f"worker {worker['pid']} (echo) terminated as the fire stopped" in result.rollup
    assert store.fires.last()["finished_at"] is not None


def test_a_second_stop_has_the_fires_workers_hand_back_their_tasks_at_once(
        store: Store, orgchart_env: dict[str, str]) -> None:
    # The workers' stop grace is 60 s and the task sleeps 60 s: after the first stop the
    # worker is still in its grace; the second has it hand the task back and exit.
    env = {**orgchart_env, "ORGCHART_WORKER__STOP_GRACE_SECONDS": "60"}
    task = submit(store, "echo", {"goal": "slow", "sleep": 60})
    orch = orchestrator(store, env)
    assert orch.config.kill_grace_seconds == 65.0
    thread, results = _fire_until_running(store, orch, task["id"])
    orch.stop("signal SIGTERM")
    thread.join(timeout=2.0)
    assert thread.is_alive()  # the worker gives its task the grace
    orch.stop("signal SIGTERM", now=True)
    thread.join(timeout=30)
    assert not thread.is_alive(), "the second stop did not end the workers' grace"
    (result,) = results
    (worker,) = result.stats["workers"]
    assert worker["signal"] == "SIGTERM (exited cleanly)", worker
    row = store.reads.get(task["id"])
    assert (row["status"], row["lease_owner"]) == ("pending", None)
    assert store.reads.events(task["id"])[-1]["detail"] == "released by a worker shutting down"
