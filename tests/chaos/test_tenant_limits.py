"""Chaos: a tenant's limits across real worker processes, one of them SIGKILLed.

``max_in_flight``: two ``orgchart worker`` processes (2-second leases) serve a capped
tenant's sleeping echo tasks. A sampler counts the tenant's running tasks with live leases
every 20 ms. One worker is SIGKILLed while it holds some: its tasks count until their
leases expire, then stop counting (the count comes from leases, not from a counter that
could leak), so the survivor runs the tenant at its full limit again, and every task
finishes once.

``tokens_per_minute``: two workers serve a metered tenant's model-calling leaves and an
unlimited tenant's; one is SIGKILLed (the reservations it held are never settled). The
metered tenant's calls (``model_calls`` rows: tokens and times) never pass what its
bucket gives (one minute's worth, then the rate), the survivor keeps calling as the bucket
refills, and the unlimited tenant's tasks are not held back.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from runtime.audit.history import Recorder
from runtime.store.rows import NewTask
from runtime.store.store import Store
from tests.chaos.helpers import (
    Fleet,
    assert_audited,
    cli_env,
    held_by,
    status_counts,
    wait_until,
)
from tests.factories import terminal_event_counts

CAP = 3
TASKS = 15
LEASE_SECONDS = 2


@pytest.fixture
def env(orgchart_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    config = tmp_path / "tenants.toml"
    config.write_text(f"[tenants.capped]\nmax_in_flight = {CAP}\n")
    return cli_env(orgchart_env, ORGCHART_CONFIG=str(config))


@pytest.fixture
def fleet(env: dict[str, str], tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(env, tmp_path / "workers",
               ["--agents-module", "tests.support_agents", "--agents", "echo,judge",
                "--lease-seconds", str(LEASE_SECONDS)],
               Recorder(tmp_path / "history.jsonl", process="test")) as f:
        yield f


def _running(store: Store) -> list[str]:
    with store.engine.connect() as conn:
        return [r[0] for r in conn.execute(sa.text(
            "SELECT lease_owner FROM tasks WHERE tenant = 'capped' AND status = 'running' "
            "AND lease_expires_at > now()"))]


def test_a_sigkilled_worker_never_leaves_the_tenants_count_high(
        fleet: Fleet, store: Store) -> None:
    for i in range(TASKS):
        store.tasks.submit(NewTask("echo", "task", {"goal": f"capped {i}", "sleep": 1.5},
                                   tenant="capped"))
    samples: list[list[str]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(_running(store))
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        workers = [fleet.start(), fleet.start()]
        victim = wait_until(lambda: next((w for w in workers if any(
            t["status"] == "running" for t in held_by(store, w.pid))), None),
            60, "a worker to hold a running capped task")
        fleet.sigkill(victim)
        killed_at = len(samples)
        survivor = next(w for w in workers if w is not victim)
        try:
            wait_until(lambda: status_counts(store).get("done", 0) == TASKS, 90,
                       "every task to finish")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {dict(status_counts(store))}, leases "
                                 f"{_running(store)}\n{survivor.log()}") from None
    finally:
        done.set()
        sampler.join(5)
    assert max(len(s) for s in samples) <= CAP, max(samples, key=len)
    # After the victim's leases expired, the survivor alone ran the tenant at its limit.
    later = samples[killed_at:]
    assert any(len(s) == CAP and all(f":{survivor.pid}:" in o for o in s) for s in later), \
        [len(s) for s in later]
    assert {t: n for t, n in terminal_event_counts(store).items() if n != 1} == {}
    assert_audited(store, fleet.recorder)


RATE = 300  # tokens a minute: about 27 offline calls (11 tokens) at once, then one every 2 s
METERED = 80
FREE = 10


def test_two_workers_never_take_more_than_the_tenants_bucket_gives(
        orgchart_env: dict[str, str], tmp_path: Path, store: Store) -> None:
    config = tmp_path / "buckets.toml"
    config.write_text(f"[tenants.metered]\ntokens_per_minute = {RATE}\n")
    env = cli_env(orgchart_env, ORGCHART_CONFIG=str(config))
    with Fleet(env, tmp_path / "workers",
               ["--agents-module", "tests.chaos.agents", "--agents", "spender,judge",
                "--lease-seconds", str(LEASE_SECONDS)],
               Recorder(tmp_path / "history.jsonl", process="test")) as fleet:
        workers = [fleet.start(), fleet.start()]
        for i in range(METERED):
            store.tasks.submit(NewTask("spender", "task", {"goal": f"metered {i}"},
                                       tenant="metered"))
        free = [store.tasks.submit(NewTask("spender", "task", {"goal": f"free {i}"}))[0]["id"]
                for i in range(FREE)]
        wait_until(lambda: all(store.reads.get(t)["status"] == "done" for t in free), 60,
                   "the unlimited tenant's tasks to finish")
        wait_until(lambda: sum(t for _, t in _metered_calls(store)) >= RATE / 2, 60,
                   "the burst of metered calls")
        fleet.sigkill(workers[0])
        killed = time.time()
        wait_until(lambda: any(at > killed + 1.0 for at, _ in _metered_calls(store)), 60,
                   "a metered call of the survivor")
    calls = _metered_calls(store)
    assert calls, "no metered call"
    for (a, _), (b, _) in itertools.combinations_with_replacement(calls, 2):
        used = sum(tokens for at, tokens in calls if a <= at <= b)
        # one minute's worth, the refill over the window, and 2 s for the charge's lag
        allowed = RATE + RATE / 60 * (b - a + 2.0)
        assert used <= allowed, (b - a, used, allowed)
    assert sum(t for _, t in calls) >= RATE / 2  # the burst was served
    assert any(at > killed + 1.0 for at, _ in calls), "the survivor made no metered call"
    done = sum(store.reads.get(t)["status"] == "done" for t in free)
    assert done == FREE
    assert_audited(store, fleet.recorder)


def _metered_calls(store: Store) -> list[tuple[float, int]]:
    """The metered tenant's calls: (epoch seconds, tokens), in time order."""
    with store.engine.connect() as conn:
        return [(float(r[0]), int(r[1])) for r in conn.execute(sa.text(
            "SELECT extract(epoch FROM m.created_at), m.prompt_tokens + m.completion_tokens "
            "FROM model_calls m JOIN tasks t ON t.id = m.task_id "
            "WHERE t.tenant = 'metered' AND NOT m.replayed ORDER BY m.created_at"))]
