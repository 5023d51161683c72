"""The schedule statements of ``queries.sql`` (``schedule_*``): ``store.schedules``.

Two processes ticking one schedule, a dead ticker, a late one: the tick's transaction
holds the schedule's row lock (taken with ``SKIP LOCKED`` by a tick, waited for by
run-now), so the ticks of one schedule run one after the other, and each reads the
``next_at`` the previous one committed. A ticker that dies mid-tick rolls back: its slots
were not recorded and nothing they started exists, so the next tick fires them. The
unique key on ``(schedule_id, slot_at)`` is the last guard: a slot recorded before is
refused, and the caller starts nothing for it.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy.engine import Connection

from runtime.errors import BadInput
from runtime.store.database import Database
from runtime.store.queries import TEXT as _TEXT
from runtime.store.rows import NewTask, NotFound, canonical_json
from runtime.store.tasks import Tasks

Row = dict[str, Any]


_rows = Database.rows


class ScheduleExists(BadInput):
    """A schedule with this name is stored already."""


class SlotWriter:
    """One schedule's tick: its locked row, and the writes of its slots.

    Every method runs in the tick's transaction (committed when the ``with`` block of
    :meth:`Schedules.tick` ends without an error).
    """

    def __init__(self, tasks: Tasks, conn: Connection, row: Row, worker: str) -> None:
        self.tasks = tasks
        self.conn = conn
        self.row = row
        self.worker = worker

    def open_runs(self, fire_open_seconds: float) -> list[Row]:
        """What the schedule started that is still open (roots not terminal, fires running).

        A fire unfinished after ``fire_open_seconds`` is taken for dead (its process was).
        """
        return _rows(self.conn, "schedule_runs_open", id=self.row["id"],
                     fire_open_seconds=fire_open_seconds)

    def record(self, slot_at: dt.datetime, state: str, detail: str | None = None,
               slots: int = 1, root_id: uuid.UUID | None = None) -> bool:
        """Record a slot (``fired``, ``skipped``, ``missed``); False when recorded before."""
        return bool(self.conn.execute(_TEXT["schedule_run_insert"], {
            "schedule_id": self.row["id"], "slot_at": slot_at, "state": state,
            "root_id": root_id, "fire_id": None, "slots": slots, "detail": detail,
            "worker": self.worker}).first())

    def fire_goal(self, slot_at: dt.datetime, new: NewTask, detail: str | None = None
                  ) -> uuid.UUID | None:
        """Record the slot and insert its root in this transaction; None when recorded before.

        The root's ``submitted`` event names the schedule as its actor.
        """
        root_id = uuid.uuid4()
        if not self.record(slot_at, "fired", detail, root_id=root_id):
            return None
        params = self.tasks.root_params(new, f"schedule:{self.row['name']}", root_id)
        self.conn.execute(_TEXT["task_insert_root"], params)
        return root_id

    def fire_fire(self, slot_at: dt.datetime, detail: str | None = None) -> int | None:
        """Record the slot and insert the ``fires`` row of the fire it starts; None if recorded.

        The fire itself runs after the commit (``Orchestrator.run_once(fire_id=...)``);
        a process that dies before it leaves the row unfinished, which ``doctor`` reports.
        """
        if not self.record(slot_at, "fired", detail):
            return None
        plan = {"status": "scheduled", "schedule": self.row["name"],
                "slot_at": slot_at.isoformat()}
        fire_id = int(self.conn.execute(_TEXT["fire_insert_started"],
                                        {"plan": canonical_json(plan)}).one().id)
        self.conn.execute(_TEXT["schedule_run_set_fire"], {
            "schedule_id": self.row["id"], "slot_at": slot_at, "fire_id": fire_id})
        return fire_id

    def advance(self, next_at: dt.datetime) -> None:
        """Move the schedule's first unhandled slot to ``next_at``."""
        self.conn.execute(_TEXT["schedule_update_next"], {"id": self.row["id"],
                                                          "next_at": next_at})


class Schedules:
    """Schedules: store, list, pause, resume, remove, and the tick's transaction.

    ``store.schedules``; ``tasks`` is the store's :class:`~runtime.store.tasks.Tasks`,
    whose ``root_params`` a goal slot's root is inserted with (the same require_approval
    parameters as any submitted root).
    """

    def __init__(self, database: Database, tasks: Tasks) -> None:
        self.database = database
        self.tasks = tasks

    def create(self, values: Mapping[str, Any]) -> Row:
        """Store a schedule (``values``: the columns of ``schedule_insert``).

        Raises:
            ScheduleExists: the name is taken (nothing is changed).

        """
        params = dict(values)
        params["task"] = None if params.get("task") is None else canonical_json(params["task"])
        with self.database.transaction() as conn:
            rows = _rows(conn, "schedule_insert", **params)
        if not rows:
            raise ScheduleExists(f"a schedule named {values['name']!r} exists: remove it first "
                                 "(`orgchart schedule remove`) or pick another name")
        return rows[0]

    def all(self) -> list[Row]:
        """Every schedule, with its last fired slot and its counts of slots per state."""
        return self.database.query("schedule_list_all")

    def active(self) -> list[Row]:
        """The schedules not paused, each with the database's clock (``db_now``)."""
        return self.database.query("schedule_list_active")

    def get(self, name: str) -> Row:
        """One schedule by name (with ``db_now``); :class:`NotFound` if there is none."""
        rows = self.database.query("schedule_get_by_name", name=name)
        if not rows:
            raise NotFound(f"no schedule named {name!r} (see `orgchart schedule list`)")
        return rows[0]

    def set_paused(self, name: str, paused: bool, next_at: dt.datetime | None = None) -> Row:
        """Pause, or resume from ``next_at``; :class:`NotFound` if there is no such schedule."""
        with self.database.transaction() as conn:
            rows = _rows(conn, "schedule_set_paused", name=name, paused=paused,
                         next_at=next_at)
        if not rows:
            raise NotFound(f"no schedule named {name!r} (see `orgchart schedule list`)")
        return rows[0]

    def remove(self, name: str) -> None:
        """Remove a schedule and its slots' rows (roots it started stay)."""
        with self.database.transaction() as conn:
            if not _rows(conn, "schedule_delete_by_name", name=name):
                raise NotFound(f"no schedule named {name!r} (see `orgchart schedule list`)")

    def runs(self, name: str, limit: int = 100) -> list[Row]:
        """A schedule's recorded slots, newest first (with each root's status)."""
        self.get(name)  # NotFound for an unknown name, not an empty list
        return self.database.query("schedule_runs_by_name", name=name, n=limit)

    def due(self, can_fire: bool, limit: int = 100) -> list[int]:
        """Ids of the schedules with a slot due now (fire schedules only if ``can_fire``)."""
        return [int(r["id"]) for r in self.database.query("schedule_list_due",
                                                          can_fire=can_fire, n=limit)]

    @contextmanager
    def tick(self, worker: str, schedule_id: int | None = None,
             name: str | None = None) -> Iterator[SlotWriter | None]:
        """One schedule's tick in one transaction, under its row lock.

        By id (a tick): the schedule is locked only if it is still due and no other
        process holds it; otherwise ``None`` is yielded. By name (run-now): the lock is
        waited for, and a schedule that does not exist raises :class:`NotFound`.
        """
        with self.database.transaction() as conn:
            if name is not None:
                rows = _rows(conn, "schedule_lock_by_name", name=name)
                if not rows:
                    raise NotFound(f"no schedule named {name!r} (see `orgchart schedule list`)")
            else:
                rows = _rows(conn, "schedule_lock_due", id=schedule_id)
            yield SlotWriter(self.tasks, conn, rows[0], worker) if rows else None
