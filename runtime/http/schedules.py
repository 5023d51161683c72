"""The HTTP face of schedules (``orgchart schedule``; docs/operations.md, "Scheduling").

- ``GET /schedules``: every schedule, with its next slot, last fired slot and counts.
- ``POST /schedules``: store one (201); a bad cron line, interval, time zone, overlap or
  window, an unknown agent or a taken name is 422, and nothing is stored.
- ``GET /schedules/{name}/runs``: its recorded slots, newest first.
- ``POST /schedules/{name}/pause`` and ``/resume``; ``DELETE /schedules/{name}``.
- ``POST /schedules/{name}/run-now``: an extra slot of a goal schedule, now. A fire
  schedule's run-now is the CLI's (the fire runs in the caller's foreground): 422 here.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Literal

from fastapi import FastAPI, Response
from pydantic import BaseModel, ConfigDict, Field

from agents.registry import Registry
from runtime.config import Settings
from runtime.errors import BadInput
from runtime.schedules.commands import (
    add_schedule,
    pause_schedule,
    resume_schedule,
    run_json,
    run_now,
    schedule_json,
)
from runtime.store.store import Store

_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"description": "no schedule with that name"},
    422: {"description": "bad input (the message says which); nothing was changed"},
}


class ScheduleRequest(BaseModel):
    """``POST /schedules``: a cadence, and a goal or the fire."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Unique; letters, digits, '_', '.', '-' (at most 64).")
    cron: str | None = Field(None, description="A cron line: '0 7 * * *'.")
    timezone: str | None = Field(None, description="The cron line's IANA time zone.")
    every: str | None = Field(None, description="An interval instead: 30s, 5m, 1h.")
    goal: str | None = Field(None, description="The goal of the root each slot starts.")
    fire: bool = Field(False, description="Each slot runs the orchestrator's fire instead.")
    agent: str = Field("ceo", description="The agent that receives the goal.")
    payload: dict[str, Any] | None = Field(None, description="Extra payload.")
    tenant: str = "default"
    priority: int = 5
    budget_tokens: int | None = None
    budget_seconds: int | None = None
    budget_usd: Decimal | None = Field(None, allow_inf_nan=False)
    success_criteria: dict[str, Any] | None = None
    kill_criteria: dict[str, Any] | None = None
    overlap: Literal["skip", "allow", "cancel_previous"] = "skip"
    catchup_window: str | None = Field(None, description="Default 1m: e.g. 1h.")


def add_schedule_routes(app: FastAPI, store: Store, settings: Settings,
                        registry: Registry) -> None:
    """Add the schedule endpoints."""
    from runtime.wiring import build_root

    @app.get("/schedules", tags=["schedules"])
    def list_schedules() -> list[dict[str, Any]]:
        """Every schedule: cadence, next slot, last fired slot, slots fired/skipped/missed."""
        return [schedule_json(r) for r in store.schedules()]

    @app.post("/schedules", status_code=201, tags=["schedules"], responses=_ERRORS)
    def create_schedule(body: ScheduleRequest) -> dict[str, Any]:
        """Store a schedule: a recurring root goal, or the orchestrator's fire."""
        if (body.goal is None) == (not body.fire):
            raise BadInput("give exactly one of goal and fire")
        task = None
        if body.goal is not None:
            budgets = {k: v for k, v in (("budget_tokens", body.budget_tokens),
                                         ("budget_seconds", body.budget_seconds),
                                         ("budget_usd", body.budget_usd)) if v is not None}
            task = build_root(registry, settings, goal=body.goal, agent=body.agent,
                              priority=body.priority, payload=body.payload,
                              success=body.success_criteria, kill=body.kill_criteria,
                              tenant=body.tenant, **budgets)  # type: ignore[arg-type]
        return add_schedule(store, name=body.name, cron=body.cron, every=body.every,
                            timezone=body.timezone, task=task, overlap=body.overlap,
                            catchup_window=body.catchup_window, actor="api")

    @app.get("/schedules/{name}/runs", tags=["schedules"], responses=_ERRORS)
    def schedule_runs(name: str, limit: int = 100) -> list[dict[str, Any]]:
        """The schedule's recorded slots, newest first (with each root's status)."""
        return [run_json(r) for r in store.schedule_runs(name, max(1, min(limit, 10_000)))]

    @app.post("/schedules/{name}/pause", tags=["schedules"], responses=_ERRORS)
    def pause(name: str) -> dict[str, Any]:
        """Pause: the schedule fires nothing until resumed."""
        return pause_schedule(store, name)

    @app.post("/schedules/{name}/resume", tags=["schedules"], responses=_ERRORS)
    def resume(name: str) -> dict[str, Any]:
        """Resume from the first slot after now."""
        return resume_schedule(store, name)

    @app.post("/schedules/{name}/run-now", tags=["schedules"], responses=_ERRORS)
    def fire_now(name: str) -> dict[str, Any]:
        """Fire an extra slot now (the overlap policy holds): its root, or why it skipped."""
        if store.schedule(name)["kind"] == "fire":
            raise BadInput(f"{name!r} schedules the fire, which runs in the caller's "
                           f"foreground: use `orgchart schedule run-now {name}`")
        return run_now(store, name, actor="api").as_dict()

    @app.delete("/schedules/{name}", status_code=204, tags=["schedules"], responses=_ERRORS)
    def remove(name: str) -> Response:
        """Remove the schedule and its recorded slots (the roots it started stay)."""
        store.schedule_remove(name)
        return Response(status_code=204)
