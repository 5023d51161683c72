"""Add, list, pause, resume, remove and run-now: one implementation for the CLI and the API.

Each validates its input before it writes (:class:`~runtime.errors.BadInput`, naming the
option, for a bad cron line, interval, time zone, overlap or window; an unknown agent or
a bad payload comes from :func:`runtime.wiring.build_root`), so bad input changes
nothing. The JSON shapes (:func:`schedule_json`, :func:`run_json`) are the ``--json``
output and the API's answers.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from runtime.config import Settings
from runtime.schedules.spec import ScheduleSpec, cadence_of, parse_cadence, parse_window
from runtime.schedules.ticker import Ticked, Ticker, TickerConfig
from runtime.store.rows import NewTask
from runtime.store.store import Store


def add_schedule(store: Store, *, name: str, cron: str | None, every: str | None,
                 timezone: str | None, task: NewTask | None, overlap: str = "skip",
                 catchup_window: str | None = None, actor: str = "cli") -> dict[str, Any]:
    """Validate and store a schedule; ``task`` None schedules the orchestrator's fire.

    Raises:
        BadInput: a bad cadence, time zone, overlap, window or name; the name is taken.

    """
    spec = ScheduleSpec(name=name, cadence=parse_cadence(cron, every, timezone), task=task,
                        overlap=overlap, catchup_seconds=parse_window(catchup_window))
    return schedule_json(store.schedules.create(spec.columns(dt.datetime.now(dt.UTC), actor)))


def pause_schedule(store: Store, name: str) -> dict[str, Any]:
    """Pause: the schedule fires nothing until resumed (its slots meanwhile are not kept)."""
    return schedule_json(store.schedules.set_paused(name, True))


def resume_schedule(store: Store, name: str) -> dict[str, Any]:
    """Resume from the first slot after now (slots that passed while paused never fire)."""
    row = store.schedules.get(name)
    next_at = cadence_of(row).next_after(row["db_now"])
    return schedule_json(store.schedules.set_paused(name, False, next_at))


def run_now(store: Store, settings: Settings, name: str, actor: str = "cli") -> Ticked:
    """Fire an extra slot now, under the schedule's overlap policy.

    A fire schedule's fire is not run here: its ``fires`` row is written, and the
    orchestrator runs it when the caller passes the id on (``orgchart fire``'s command).
    """
    return Ticker(store, TickerConfig.from_settings(settings, actor)).run_now(name)


def schedule_json(row: dict[str, Any]) -> dict[str, Any]:
    """The public shape of a schedule (``schedule list --json``, the API)."""
    task = row.get("task") or None
    out: dict[str, Any] = {
        "name": row["name"], "kind": row["kind"], "cadence": cadence_of(row).describe(),
        "cron": row["cron"], "every_seconds": row["every_seconds"],
        "timezone": row["timezone"], "overlap": row["overlap"],
        "catchup_seconds": row["catchup_seconds"], "paused": row["paused"],
        "next_at": _iso(row["next_at"]), "created_at": _iso(row.get("created_at")),
        "agent": task["to_agent"] if task else None,
        "goal": (task.get("payload") or {}).get("goal") if task else None,
        "tenant": task.get("tenant") if task else None,
    }
    for key in ("last_fired_at", "last_root_id", "last_fire_id", "fired", "skipped", "missed"):
        if key in row:
            value = row[key]
            out[key] = _iso(value) if isinstance(value, dt.datetime) else (
                str(value) if key == "last_root_id" and value is not None else value)
    return out


def run_json(row: dict[str, Any]) -> dict[str, Any]:
    """The public shape of one recorded slot (``schedule runs``)."""
    latency = None
    if row.get("root_created_at") is not None:
        latency = round((row["root_created_at"] - row["slot_at"]).total_seconds(), 3)
    return {"slot_at": _iso(row["slot_at"]), "state": row["state"],
            "root_id": str(row["root_id"]) if row["root_id"] else None,
            "root_status": row.get("root_status"), "fire_id": row["fire_id"],
            "slots": row["slots"], "detail": row["detail"], "worker": row["worker"],
            "recorded_at": _iso(row["recorded_at"]), "latency_seconds": latency}


def _iso(value: Any) -> str | None:
    return value.isoformat() if isinstance(value, dt.datetime) else None
