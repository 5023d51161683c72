"""What the failover and partition tests share: workers' environment, the work, the checks."""

from __future__ import annotations

import datetime as dt
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from runtime.config import Settings
from runtime.store.postgres import engines, failover
from runtime.store.store import Store
from runtime.wiring import build_root, load_registry, submit_root
from tests.chaos.helpers import REPO_ROOT, duplicate_children
from tests.factories import terminal_event_counts
from tests.fake_ollama import FakeOllama, request_identity

#: The tree of ``bench.agents``: a planner, ``LEADS`` leads, ``WRITERS`` writers each.
BENCH_MODULE = "bench.agents"
SEED_GOALS = ("Assess the market for durable agent runtimes in {}",
              "Map the competitors of a hosted Postgres queue in {}",
              "Estimate the demand for agent observability tools in {}",
              "Find the risks of running LLM agents in production in {}")
REGIONS = ("Europe", "Japan", "Brazil", "Canada", "India", "Kenya", "Chile", "Norway",
           "Vietnam", "Mexico")


def worker_env(base: dict[str, str], url: str, model_url: str, home: Path,
               **extra: str) -> dict[str, str]:
    """The environment of an ``orgchart`` process on the formation and the fake model."""
    env = {k: v for k, v in base.items() if not k.startswith("ORGCHART_")}
    config = home / "orgchart.toml"
    home.mkdir(parents=True, exist_ok=True)
    config.write_text("")
    env.update({
        "ORGCHART_DATABASE_URL": url, "ORGCHART_HOME": str(home),
        "ORGCHART_CONFIG": str(config), "ORGCHART_LLM__BACKEND": "ollama",
        "ORGCHART_OLLAMA__URL": model_url, "ORGCHART_OLLAMA__MAX_PARALLEL": "200",
        "ORGCHART_OLLAMA__CLOUD_MAX_PARALLEL": "200",
        "ORGCHART_WORKER__POLL_INTERVAL_SECONDS": "0.5",
        "ORGCHART_WORKER__MAINTENANCE_INTERVAL_SECONDS": "0.5",
        "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1",
    })
    env.update(extra)
    return env


def seed_goal(i: int) -> str:
    """A distinct goal for the seed's org (distinct prompts: a repeat means paid twice)."""
    return SEED_GOALS[i % len(SEED_GOALS)].format(REGIONS[i // len(SEED_GOALS) % 10]) + \
        f" (#{i})"


def submit_work(store: Store, seed_roots: int, leads: int, writers: int) -> list[uuid.UUID]:
    """Submit ``seed_roots`` roots of the seed's org and one bench tree; their ids."""
    settings = Settings()
    registry = load_registry(settings, [BENCH_MODULE])
    ids = []
    for i in range(seed_roots):
        new = build_root(registry, settings, goal=seed_goal(i))
        ids.append(submit_root(store, new, "test", timeout=60)[0]["id"])
    tree = build_root(registry, settings, goal="ha tree", agent="mk_planner",
                      payload={"leads": leads, "writers": writers},
                      budget_tokens=10_000_000, budget_usd="1000")
    ids.append(submit_root(store, tree, "test", timeout=60)[0]["id"])
    return ids


def attempt(fn: Callable[[], Any], default: Any = None) -> Any:
    """``fn()``, or ``default`` while the database is away (other errors are raised)."""
    try:
        return fn()
    except sa.exc.DBAPIError as exc:
        if not failover.is_failover_error(exc):
            raise
        return default


def scalar(store: Store, sql: str, **params: Any) -> Any:
    """One value from the database."""
    with store.engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def rows(store: Store, sql: str, **params: Any) -> list[Any]:
    """All rows of a query."""
    with store.engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params).all())


def wait_for(condition: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.2) -> Any:
    """Poll ``condition`` (database errors count as not yet) until truthy; fail naming it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = attempt(condition)
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def roots_done(store: Store, ids: Iterable[uuid.UUID]) -> bool:
    """Whether every root in ``ids`` is finished."""
    wanted = list(ids)
    done = scalar(store, "SELECT count(*) FROM tasks WHERE id = ANY(:ids) AND status IN "
                  "('done', 'failed', 'escalated')", ids=wanted)
    return int(done or 0) == len(wanted)


def answered_more_than_once(servers: Iterable[FakeOllama]) -> Counter[str]:
    """Requests (by identity) the servers answered more than once, with their counts."""
    answered: Counter[str] = Counter()
    for server in servers:
        answered.update(server.answered)
    return Counter({k: n for k, n in answered.items() if n > 1})


def paid_twice(servers: Iterable[FakeOllama]) -> int:
    """Requests a model server answered more than once (each extra answer counts)."""
    return sum(n - 1 for n in answered_more_than_once(servers).values())


def check_history(store: Store, roots: list[uuid.UUID]) -> dict[str, Any]:
    """The invariants every fault test asserts; returned so they can be printed."""
    statuses = dict(rows(store, "SELECT status, count(*) FROM tasks GROUP BY status"))
    once = terminal_event_counts(store)
    root_status = dict(rows(store, "SELECT id, status FROM tasks WHERE id = ANY(:ids)",
                            ids=roots))
    return {
        "tasks": sum(statuses.values()), "statuses": statuses,
        "missing_roots": [str(r) for r in roots if r not in root_status],
        "roots_not_done": {str(k): v for k, v in root_status.items() if v != "done"},
        "terminal_events_not_once": {str(k): v for k, v in once.items() if v != 1},
        "duplicate_children": duplicate_children(store),
    }


def identities(server: FakeOllama) -> set[str]:
    """Every request the server has received, by identity."""
    return {request_identity(r) for r in list(server.requests)}


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def first_log_time(log: str, needle: str) -> float | None:
    """The time (epoch seconds) of the first log line containing ``needle``."""
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m and needle in line:
            stamp = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
            return stamp.timestamp() + int(m.group(2)) / 1000
    return None


def store_on(url: str) -> Store:
    """A store on the formation (several hosts)."""
    return Store(engines.create_db_engine(url, pool_size=2))
