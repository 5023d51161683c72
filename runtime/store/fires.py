"""The orchestrator's bookkeeping: its fires, the lock one fire holds, the events it counts.

A part of the store (``store.fires``, :class:`Fires`). A fire is a ``fires`` row, inserted
when it starts and given its plan, stats and rollup note when it ends; one fire runs at a
time, under an advisory lock held on a connection of its own (:meth:`Fires.lock`); its
rollup counts the ``task_events`` written after the watermark read before it started.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from runtime.store.database import Database
from runtime.store.queries import TEXT as _TEXT
from runtime.store.queries import Task
from runtime.store.rows import canonical_json

log = logging.getLogger(__name__)

_rows = Database.rows


class Fires:
    """Fires' rows, the fire lock, and the event counts a fire's rollup reads: ``store.fires``."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def started(self, plan: dict[str, Any]) -> int:
        """Insert a fires row for a fire that is starting; return its id."""
        with self.database.transaction() as conn:
            return int(conn.execute(_TEXT["fire_insert_started"],
                                    {"plan": canonical_json(plan)}).one().id)

    def finished(self, fire_id: int, plan: dict[str, Any], stats: dict[str, Any],
                      rollup: str) -> Task:
        """Record a fire's plan, stats and rollup note."""
        with self.database.transaction() as conn:
            return _rows(conn, "fire_update_finished", id=fire_id, plan=canonical_json(plan),
                         stats=canonical_json(stats), rollup=rollup)[0]

    def count_since(self, since: dt.datetime) -> int:
        """How many fires started since ``since``."""
        with self.database.connect() as conn:
            return int(conn.execute(_TEXT["fire_count_since"], {"since": since}).scalar_one())

    def last(self) -> Task | None:
        """The most recent fire, or None."""
        rows = self.database.query("fire_get_last")
        return rows[0] if rows else None

    @contextmanager
    def lock(self, key: int) -> Iterator[bool]:
        """Try the fire's advisory lock on a dedicated connection held until the block ends.

        Yields whether the lock was taken. The connection is not pooled: closing it at the
        end releases the lock even if the unlock statement cannot run.
        """
        engine = sa.create_engine(self.database.engine.url, poolclass=sa.pool.NullPool)
        try:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                locked = bool(conn.execute(_TEXT["fire_lock_try"], {"key": key}).scalar())
                try:
                    yield locked
                finally:
                    if locked:
                        try:
                            conn.execute(_TEXT["fire_lock_release"], {"key": key})
                        except sa.exc.DBAPIError:
                            log.warning("could not release the fire lock; closing the connection")
        finally:
            engine.dispose()

    def event_watermark(self) -> int:
        """The newest task_events id (events written later have larger ids)."""
        with self.database.connect() as conn:
            return int(conn.execute(_TEXT["task_event_max_id"]).scalar_one())

    def event_counts_by_worker(self, after_id: int, prefixes: Sequence[str]) -> list[Task]:
        """Transitions after ``after_id`` by workers whose id starts with one of ``prefixes``."""
        if not prefixes:
            return []
        return self.database.query("task_event_count_by_worker", after_id=after_id,
                                   prefixes=list(prefixes))

    def failures_since(self, after_id: int, prefixes: Sequence[str],
                       limit: int = 20) -> list[Task]:
        """Failed/escalated transitions after ``after_id``, grouped by status, agent, error."""
        if not prefixes:
            return []
        return self.database.query("task_event_count_failures", after_id=after_id,
                                   prefixes=list(prefixes), limit=limit)
