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

from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from agents.registry import Registry
from runtime.config import Settings
from runtime.errors import BadInput
from runtime.http.schedule_request import ScheduleRequest, never_falls
from runtime.schedules.commands import (
    add_schedule,
    pause_schedule,
    resume_schedule,
    run_json,
    run_now,
    schedule_json,
)
from runtime.store.schedules import ScheduleExists
from runtime.store.store import Store

_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"description": "no schedule with that name"},
    409: {"description": "a schedule of that name exists"},
    422: {"description": "bad input (the message says which); nothing was changed"},
}


async def _exists(_: Request, exc: Exception) -> Response:
    return JSONResponse({"error": str(exc)}, status_code=409)


def add_schedule_routes(app: FastAPI, store: Store, settings: Settings,
                        registry: Registry) -> None:
    """Add the schedule endpoints (a taken name answers 409: the same body may fit later)."""
    from runtime.wiring import build_root

    app.add_exception_handler(ScheduleExists, _exists)

    @app.get("/schedules", tags=["schedules"])
    def list_schedules() -> list[dict[str, Any]]:
        """Every schedule: cadence, next slot, last fired slot, slots fired/skipped/missed."""
        return [schedule_json(r) for r in store.schedules.all()]

    @app.post("/schedules", status_code=201, tags=["schedules"], responses=_ERRORS)
    def create_schedule(body: ScheduleRequest) -> dict[str, Any]:
        """Store a schedule: a recurring root goal, or the orchestrator's fire."""
        if body.cron is not None and never_falls(body.cron, body.timezone):
            raise BadInput(f"cron line {body.cron!r} never falls (a day no month has)")
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
        return [run_json(r) for r in store.schedules.runs(name, max(1, min(limit, 10_000)))]

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
        if store.schedules.get(name)["kind"] == "fire":  # this schedule's kind: a conflict
            raise HTTPException(409, f"{name!r} schedules the fire, which runs in the "
                                f"caller's foreground: use `orgchart schedule run-now {name}`")
        return run_now(store, settings, name, actor="api").as_dict()

    @app.delete("/schedules/{name}", status_code=204, tags=["schedules"], responses=_ERRORS)
    def remove(name: str) -> Response:
        """Remove the schedule and its recorded slots (the roots it started stay)."""
        store.schedules.remove(name)
        return Response(status_code=204)
