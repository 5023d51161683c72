"""Chaos: four tasks of six tool calls each, a worker SIGKILLed every 1.5 s.

Each task of ``six_tools`` asks the (fake, loopback) model, which calls the ``work`` tool
six times, one call per round; each call sleeps 0.5 s and appends one line keyed by its
idempotency key to a side-effect log. Every 1.5 s the worker holding the most tasks is
SIGKILLed (a replacement is always starting), once it has held them for one tool call's
time and a little more: a fleet whose every holder dies before its first tool call can
end cannot progress at all, which proves nothing about the record (with a 1 s lease, a
takeover comes up to a second after a kill; before this rule the test livelocked on a
slower machine: 100 kills, each inside the same second tool call). At the end every task
is ``done``; a side effect ran twice only for a call in flight at a kill, and a model
request reached the server twice only when it was in flight at a kill: the rest was
replayed from the record. The figures are printed as one ``STEPS_UNDER_CRASH {json}`` line
(``bench/tools.py`` reads it).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from runtime.store.rows import NewTask
from runtime.store.store import Store
from tests.chaos.agents import SIDE_EFFECTS_ENV, TOOL_SECONDS
from tests.chaos.helpers import (
    Fleet,
    assert_audited,
    cli_env,
    held_by,
    record_model_server,
)
from tests.fake_ollama import FakeOllama, calls_until, fake_ollama_server  # noqa: F401

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

TASKS = 4
TOOL_CALLS = 6
KILL_EVERY_SECONDS = 1.5
MODEL_SECONDS = 0.05
#: A holder is killed only when its newest claim is this old: one tool call and margin.
MIN_HOLD_SECONDS = TOOL_SECONDS + 0.3
DEADLINE_SECONDS = 200.0


def in_flight(store: Store, task_ids: list[str]) -> int:
    """Tool calls started and not finished among these tasks (what a kill interrupts)."""
    if not task_ids:
        return 0
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM task_steps WHERE status = 'started' "
            "AND task_id = ANY(CAST(:ids AS uuid[]))"), {"ids": task_ids}).scalar_one())


def test_tool_calls_survive_a_kill_every_one_and_a_half_seconds(
        store: Store, fake_ollama: FakeOllama, tmp_path: Path,
        make_fleet: Callable[[list[str]], Fleet]) -> None:
    fake_ollama.delay_seconds = MODEL_SECONDS
    fake_ollama.tool_plan = calls_until(TOOL_CALLS, "work")
    log = tmp_path / "side_effects.log"
    log.touch()
    ids = [store.tasks.submit(NewTask(to_agent="six_tools", type="task", budget_seconds=3600,
                                      payload={"goal": f"job {i}"}))[0]["id"] for i in range(TASKS)]
    fleet = make_fleet(["--agents-module", "tests.chaos.agents",
                        "--agents", "six_tools,judge"])
    fleet.env = cli_env(fleet.env, ORGCHART_LLM__BACKEND="ollama",
                        ORGCHART_OLLAMA__URL=fake_ollama.url,
                        ORGCHART_WORKER__LEASE_SECONDS="1",
                        ORGCHART_RETRY__MAX_DELIVERY="100", **{SIDE_EFFECTS_ENV: str(log)})
    started = time.monotonic()
    next_kill = started + KILL_EVERY_SECONDS
    kills, held_at_kills, tools_in_flight = 0, 0, 0
    while time.monotonic() - started < DEADLINE_SECONDS:
        if len(fleet.alive()) < 2:
            fleet.start()
        time.sleep(0.05)
        if all(store.reads.get(i)["status"] == "done" for i in ids):
            break
        if time.monotonic() < next_kill:
            continue
        held = {w.pid: held_by(store, w.pid) for w in fleet.alive()}
        pid = max(held, key=lambda p: len(held[p]), default=None)
        if pid is None or not held[pid]:
            next_kill = time.monotonic() + KILL_EVERY_SECONDS
            continue
        if min(t["held_seconds"] for t in held[pid]) < MIN_HOLD_SECONDS:
            continue  # the kill waits until the holder has had one tool call's time
        next_kill = time.monotonic() + KILL_EVERY_SECONDS
        victim = next(w for w in fleet.alive() if w.pid == pid)
        # Read just before the kill: a call that starts in between is counted by the
        # bound on held tasks (each task runs one tool call at a time).
        tools_in_flight += in_flight(store, [str(t["id"]) for t in held[pid]])
        held_at_kills += len(held[pid])
        fleet.sigkill(victim)
        kills += 1
    elapsed = time.monotonic() - started
    fleet.close()
    statuses = Counter(store.reads.get(i)["status"] for i in ids)
    lines = Counter(log.read_text().split())
    duplicated_effects = sum(n - 1 for n in lines.values())
    resent_requests = sum(n - 1 for n in fake_ollama.seen.values())
    with store.engine.connect() as conn:
        paid_twice = int(conn.execute(sa.text(
            "SELECT count(*) FROM (SELECT task_id, position FROM model_calls WHERE NOT replayed "
            "AND error IS NULL GROUP BY task_id, position HAVING count(*) > 1) x")).scalar_one())
        starts, replays = conn.execute(sa.text(
            "SELECT COALESCE(sum(starts), 0), COALESCE(sum(replays), 0) FROM task_steps")).one()
    figures = {
        "tasks": TASKS, "tool_calls_per_task": TOOL_CALLS, "kills": kills,
        "kill_every_seconds": KILL_EVERY_SECONDS, "tasks_done": statuses["done"],
        "side_effects": sum(lines.values()), "distinct_tool_calls": len(lines),
        "duplicated_side_effects": duplicated_effects,
        "tool_calls_in_flight_at_kills": tools_in_flight,
        "tasks_held_at_kills": held_at_kills, "step_starts": int(starts),
        "step_replays": int(replays), "model_requests": sum(fake_ollama.seen.values()),
        "distinct_model_requests": len(fake_ollama.seen),
        "model_requests_resent": resent_requests, "model_calls_paid_twice": paid_twice,
        "seconds": round(elapsed, 1),
    }
    print("STEPS_UNDER_CRASH " + json.dumps(figures))
    assert statuses["done"] == TASKS, (statuses, [w.log() for w in fleet.workers][-2:])
    assert kills >= 2
    assert len(lines) == TASKS * TOOL_CALLS
    # A side effect repeats only for a call in flight at a kill: each task runs one tool
    # call at a time, so a kill interrupts at most one call per task it held.
    assert duplicated_effects <= held_at_kills
    # The same holds for model requests: at most one in flight per task at a kill.
    assert resent_requests <= held_at_kills
    assert len(fake_ollama.seen) == TASKS * (TOOL_CALLS + 1)
    assert paid_twice <= held_at_kills
    record_model_server(fleet.recorder, fake_ollama)
    assert_audited(store, fleet.recorder)
