"""Chaos: a ten-call agent finishes while its workers are SIGKILLed every 2.5 seconds.

The agent makes ten sequential model calls; the loopback Ollama-compatible server takes
0.4 s per call. Every worker that takes the task is SIGKILLed 2.5 s after it took it (a
spare worker is always starting, since starting Python can itself take seconds on a
loaded machine), so no worker holds the task long enough to make all ten. Each delivery is served
the replies already recorded (charged zero, rows marked ``replayed``) and makes only the
new calls. At the end the task is ``done`` and the server saw each distinct request at
most once more than its reply was recorded (the once: a worker killed while waiting for
the reply, which was never recorded).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest

from runtime.store.rows import NewTask
from runtime.store.store import Store
from tests.chaos.helpers import Fleet, assert_audited, cli_env, record_model_server
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

KILL_EVERY_SECONDS = 2.5
CALL_SECONDS = 0.4
DEADLINE_SECONDS = 150.0


def test_ten_sequential_calls_survive_a_kill_every_two_and_a_half_seconds(
        store: Store, fake_ollama: FakeOllama,
        make_fleet: Callable[[list[str]], Fleet]) -> None:
    fake_ollama.delay_seconds = CALL_SECONDS
    root, _ = store.tasks.submit(NewTask(to_agent="ten_calls", type="task",
                                         payload={"goal": "a durable agent runtime"},
                                         budget_seconds=3600))
    task_id = root["id"]
    fleet = make_fleet(["--agents-module", "tests.chaos.agents", "--agents",
                        "ten_calls,judge"])
    fleet.env = cli_env(fleet.env, ORGCHART_LLM__BACKEND="ollama",
                        ORGCHART_OLLAMA__URL=fake_ollama.url,
                        ORGCHART_WORKER__LEASE_SECONDS="1",
                        ORGCHART_RETRY__MAX_DELIVERY="100")
    started = time.monotonic()
    kills = 0
    took: dict[int, float] = {}
    while time.monotonic() - started < DEADLINE_SECONDS:
        if len(fleet.alive()) < 2:
            fleet.start()
        time.sleep(0.1)
        row = store.reads.get(task_id)
        if row["status"] == "done":
            break
        owner = row.get("lease_owner")
        if not owner:
            continue
        pid = int(owner.split(":")[1])
        took.setdefault(pid, time.monotonic())
        if time.monotonic() - took[pid] >= KILL_EVERY_SECONDS:
            victim = next((w for w in fleet.alive() if w.pid == pid), None)
            if victim is not None:
                fleet.sigkill(victim)
                kills += 1
    fleet.close()
    task = store.reads.get(task_id)
    calls = store.reads.model_calls(task_id)
    recorded = Counter(c["prompt"] for c in calls if c["error"] is None and not c["replayed"])
    seen = Counter(next(m["content"] for m in r["messages"] if m["role"] == "user")
                   for r in fake_ollama.requests)
    replays = sum(1 for c in calls if c["replayed"])
    deliveries = len({c["attempt"] for c in calls})
    print(f"{kills} kills, {deliveries} deliveries, {len(calls)} model_calls rows "
          f"({replays} replayed), server saw {sum(seen.values())} requests for "
          f"{len(recorded)} recorded replies in {time.monotonic() - started:.1f}s")
    assert task["status"] == "done", (task["status"], task["error"])
    assert kills >= 1 and deliveries >= 2
    # No delivery made all ten calls itself: each finished what the dead ones recorded.
    made = Counter(c["attempt"] for c in calls if c["error"] is None and not c["replayed"])
    assert max(made.values()) < 10, made
    assert len(recorded) == 10 and all(n == 1 for n in recorded.values())
    assert all(seen[prompt] <= recorded[prompt] + 1 for prompt in seen), seen
    assert replays > 0
    assert all(c["cost_usd"] == 0 and c["prompt_tokens"] == 0 for c in calls if c["replayed"])
    # What the task paid is exactly what the recorded (not replayed) calls cost.
    assert task["own_tokens"] == sum(c["prompt_tokens"] + c["completion_tokens"]
                                     for c in calls)
    record_model_server(fleet.recorder, fake_ollama)
    assert_audited(store, fleet.recorder)
