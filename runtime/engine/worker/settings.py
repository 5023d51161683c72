"""A worker's options (:class:`WorkerConfig`), what it did (:class:`WorkerStats`), its constants."""

from __future__ import annotations

import os
import socket
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy as sa

from runtime.config import RetrySettings, Settings, WorkerSettings

#: The agent name that stands for the judge stage (in ``agents`` and in notifications).
JUDGE = "judge"
DB_RETRY_MAX_SECONDS = 5.0
#: How long the writer waits for more actions before it writes a batch.
WRITE_WINDOW_SECONDS = 0.003
#: Threads that run the blocking database calls (claims, writes, maintenance).
DB_THREADS = 4
#: Claims of ``batch_size`` sent at once when there is room for more (without a task cap).
CLAIMS_AT_ONCE = 3
#: Tasks held per sync thread when every agent served is a sync one (see ``Scheduler.limit``).
SYNC_PREFETCH = 4
#: Besides, a sync worker holds what it finishes in this long at its recent pace (ditto).
HOLD_AHEAD_SECONDS = 0.25
#: Errors that mean "the database is unreachable or busy right now": retried, never fatal.
DB_ERRORS: tuple[type[Exception], ...] = (sa.exc.DBAPIError, sa.exc.TimeoutError,
                                          psycopg.Error)


def new_worker_id() -> str:
    """``host:pid:random`` so leases name who holds them."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerConfig:
    """How one worker runs: its ``[worker]`` and ``[retry]`` sections and the run's own fields.

    The sections hold every user-facing value, its default and its validation, once
    (:mod:`runtime.config`): read them there (``config.worker.lease_seconds``). The
    fields here are what a run adds (the agents, whose trees, a task cap, ...). Build one
    with :meth:`from_settings`.
    """

    agents: tuple[str, ...]
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    retry: RetrySettings = field(default_factory=RetrySettings)
    worker_id: str = field(default_factory=new_worker_id)
    task_cap: int | None = None
    wall_clock_seconds: float | None = None
    once: bool = False
    maintenance: bool = True
    listen: bool = True
    #: Claim only in these trees (by root id): ``orgchart run`` and ``Client.run`` run the
    #: tree they submitted, never another goal waiting in the queue. None: every tree.
    root_ids: tuple[uuid.UUID, ...] | None = None

    def __post_init__(self) -> None:
        if not self.agents:
            raise ValueError("a worker needs at least one agent to serve")
        if self.task_cap is not None and self.task_cap < 1:
            raise ValueError("task_cap must be at least 1")
        if self.wall_clock_seconds is not None and self.wall_clock_seconds <= 0:
            raise ValueError("wall_clock_seconds must be positive")

    @classmethod
    def from_settings(cls, settings: Settings, agents: tuple[str, ...],
                      **overrides: Any) -> WorkerConfig:
        """``[worker]`` and ``[retry]`` with the non-None ``overrides`` on top.

        An override naming a key of either section is validated by it; the others are
        this class's own fields (``task_cap``, ``once``, ``root_ids``, ...).

        Raises:
            ValueError: an override is out of range (the message names it).

        """
        given = {k: v for k, v in overrides.items() if v is not None}
        worker, retry = settings.worker.override_from(given), settings.retry.override_from(given)
        return cls(agents=agents, worker=worker, retry=retry, **given)

    @property
    def run_agents(self) -> list[str]:
        """Agents whose pending tasks this worker claims.

        ``judge`` means the judge stage and also the built-in ``judge`` agent, whose
        tasks (a rubric submitted or delegated to it) are claimed like any other's.
        """
        return list(self.agents)

    @property
    def judges(self) -> bool:
        """Whether this worker runs the judge stage."""
        return JUDGE in self.agents

    @property
    def notifications(self) -> set[str]:
        """The notification payloads that mean work for this worker."""
        return set(self.run_agents) | ({JUDGE} if self.judges else set())


@dataclass
class WorkerStats:
    """What a worker did; printed by ``orgchart worker`` and counted by fires."""

    claimed: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    delegated: int = 0
    retried_children: int = 0
    stale: int = 0
    dropped: int = 0
    released: int = 0
    reaped: int = 0
    poisoned: int = 0
    timed_out: int = 0
    swept: int = 0
    db_errors: int = 0
    stop_reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        return {
            "claimed": self.claimed, "outcomes": dict(self.outcomes),
            "delegated": self.delegated, "retried_children": self.retried_children,
            "stale": self.stale, "dropped": self.dropped, "released": self.released,
            "reaped": self.reaped, "poisoned": self.poisoned, "timed_out": self.timed_out,
            "swept": self.swept, "db_errors": self.db_errors, "stop_reason": self.stop_reason,
        }
