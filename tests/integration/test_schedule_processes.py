"""Acceptance: real ``orgchart worker`` processes tick one schedule; one is SIGKILLed.

A schedule fires every second; three workers tick it (and run its roots). Midway one
worker is SIGKILLed, perhaps inside a tick's transaction: what it had not committed is
rolled back and fired by another. Afterwards every slot from the first to the last is
recorded exactly once, fired, with its own root, and nothing was missed.
"""

from __future__ import annotations

import datetime as dt
import itertools
import subprocess
from pathlib import Path
from typing import Any

from runtime.store.store import Store
from tests.chaos.helpers import Fleet, cli, cli_env, wait_until

MODULE = "tests.support_agents"
WORKERS = 3
SLOTS_BEFORE_KILL = 3
SLOTS_AFTER_KILL = 4
TIMEOUT = 60.0


def _fired(store: Store) -> list[dict[str, Any]]:
    return [r for r in store.schedules.runs("every-second", 100_000) if r["state"] == "fired"]


def test_every_slot_fires_once_across_worker_processes_one_killed(
        orgchart_env: dict[str, str], store: Store, tmp_path: Path) -> None:
    env = cli_env(orgchart_env)
    added = subprocess.run(cli("schedule", "add", "every-second", "--every", "1s", "--goal",
                               "tick", "--agent", "noop", "--overlap", "allow",
                               "--agents-module", MODULE), env=env, capture_output=True,
                           text=True, timeout=60)
    assert added.returncode == 0, added.stderr
    with Fleet(env, tmp_path / "workers", ["--agents-module", MODULE, "--lease-seconds",
                                           "2"]) as fleet:
        workers = [fleet.start() for _ in range(WORKERS)]
        wait_until(lambda: len(_fired(store)) >= SLOTS_BEFORE_KILL, TIMEOUT,
                   "the first slots fired")
        fleet.sigkill(workers[0])
        at_kill = len(_fired(store))
        wait_until(lambda: len(_fired(store)) >= at_kill + SLOTS_AFTER_KILL, TIMEOUT,
                   "slots fired after the kill")
        store.schedules.set_paused("every-second", True)
        assert not fleet.unexpected_exits()
    runs = list(reversed(store.schedules.runs("every-second", 100_000)))
    slots = [r["slot_at"] for r in runs]
    assert len(slots) == len(set(slots))
    assert {r["state"] for r in runs} == {"fired"}  # none skipped, none missed
    assert all(b - a == dt.timedelta(seconds=1) for a, b in itertools.pairwise(slots))
    roots = [r["root_id"] for r in runs]
    assert len(set(roots)) == len(roots) and all(r["root_status"] for r in runs)
