"""The steering endpoints: cancel, pause and resume, the inbox, answers and approvals.

- ``POST /tasks/{id}/cancel`` (``{"note"}``): cancel a task and its open subtree;
- ``POST /trees/{root_id}/pause`` and ``/resume``: hold and release a whole tree;
  ``GET /trees/{root_id}/pause`` says whether it is paused;
- ``GET /inbox``: questions to ``human``, tasks awaiting approval, escalations;
- ``POST /tasks/{id}/answer`` (``{"answer", "by"}``): answer a question (422 when the
  answer does not fit its ``answer_schema`` or ``choices``: nothing changes);
- ``POST /tasks/{id}/approve`` (``{"note"}``), ``POST /tasks/{id}/reject`` (``{"note"}``,
  required).

A no-op (cancelling a finished task, approving twice, pausing a paused tree) answers
200 with ``changed: false`` and a message saying why; a missing task is 404.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from runtime.http.constraints import Json, NonBlankText, Text
from runtime.store.steering import SteeringConflict, SteeringRefused
from runtime.store.store import Store
from runtime.views import inbox_json, steer_json
from runtime.wiring import check_storable

_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"description": "no task ..."},
    409: {"description": "the task's state forbids it (an answer to no open question)"},
    422: {"description": "the request is malformed, or the answer does not fit"},
}


class NoteRequest(BaseModel):
    """A note kept in the task's history (who comes from the ``by`` field)."""

    model_config = ConfigDict(extra="forbid")

    note: Text | None = Field(None, max_length=10_000, description="Kept in the history.")
    by: Text | None = Field(None, max_length=200, description="Who (default 'api').")


class RejectRequest(BaseModel):
    """``POST /tasks/{id}/reject``: why (required, not blank: the failed task's error)."""

    model_config = ConfigDict(extra="forbid")

    note: NonBlankText = Field(..., max_length=10_000, description="Why: the task's error.")
    by: Text | None = Field(None, max_length=200, description="Who (default 'api').")


class AnswerRequest(BaseModel):
    """``POST /tasks/{id}/answer``: the answer to a question."""

    model_config = ConfigDict(extra="forbid")

    answer: Json = Field(..., description="Checked against answer_schema and choices.")
    by: Text | None = Field(None, max_length=200, description="Who answers (default 'api').")


def add_steering_routes(app: FastAPI, store: Store) -> None:
    """Add the steering endpoints to ``app``.

    A refused command answers 422 (bad input: an answer that does not fit, a pause of a
    task that is no root), or 409 when the task's state forbids it (an answer to a task
    that is no open question).
    """

    async def refused(_: Request, exc: Exception) -> Response:
        status = 409 if isinstance(exc, SteeringConflict) else 422
        return JSONResponse({"error": str(exc)}, status_code=status)

    app.add_exception_handler(SteeringRefused, refused)

    def actor(body: NoteRequest | AnswerRequest | RejectRequest | None) -> str:
        by = body.by if body is not None else None
        check_storable(by, "by")
        return by or "api"

    @app.post("/trees/{root_id}/pause", tags=["steering"], responses=_ERRORS)
    def pause_tree(root_id: uuid.UUID, body: NoteRequest | None = None) -> dict[str, Any]:
        """Pause a tree: no claims, no new model calls; leases stay alive."""
        note = body.note if body else None
        check_storable(note, "note")
        return steer_json(store.steering.pause(root_id, actor=actor(body), note=note))

    @app.post("/trees/{root_id}/resume", tags=["steering"], responses=_ERRORS)
    def resume_tree(root_id: uuid.UUID, body: NoteRequest | None = None) -> dict[str, Any]:
        """Resume a paused tree where it stood."""
        return steer_json(store.steering.resume(root_id, actor=actor(body)))

    _add_tree_routes(app, store, actor)
    _add_task_routes(app, store, actor)


def _add_tree_routes(app: FastAPI, store: Store, actor: Any) -> None:
    @app.get("/trees/{root_id}/pause", tags=["steering"], responses=_ERRORS)
    def get_pause(root_id: uuid.UUID) -> dict[str, Any]:
        """Whether a tree is paused: ``paused``, and since when, by whom, why."""
        store.reads.get(root_id)  # 404 for a missing task
        pause = store.steering.pause_of(root_id)
        return {"root_id": str(root_id), "paused": pause is not None,
                "paused_at": pause["paused_at"].isoformat() if pause else None,
                "paused_by": pause["paused_by"] if pause else None,
                "note": pause["note"] if pause else None}


def _add_task_routes(app: FastAPI, store: Store, actor: Any) -> None:
    @app.post("/tasks/{task_id}/cancel", tags=["steering"], responses=_ERRORS)
    def cancel_task(task_id: uuid.UUID, body: NoteRequest | None = None) -> dict[str, Any]:
        """Cancel a task and every open task below it (``cancelled``, one event each)."""
        note = body.note if body else None
        check_storable(note, "note")
        return steer_json(store.steering.cancel(task_id, actor=actor(body), note=note))

    @app.get("/inbox", tags=["steering"])
    def list_inbox() -> list[dict[str, Any]]:
        """What waits for a person, oldest first: questions, approvals, escalations."""
        return [inbox_json(r) for r in store.steering.inbox()]

    @app.post("/tasks/{task_id}/answer", tags=["steering"], responses=_ERRORS)
    def answer_task(task_id: uuid.UUID, body: AnswerRequest) -> dict[str, Any]:
        """Answer a question to ``human``; its parent's fan-in follows at once."""
        check_storable(body.answer, "answer")
        return steer_json(store.steering.answer(task_id, body.answer, actor=actor(body)))

    @app.post("/tasks/{task_id}/approve", tags=["steering"], responses=_ERRORS)
    def approve_task(task_id: uuid.UUID, body: NoteRequest | None = None) -> dict[str, Any]:
        """Let a task held for approval run (once)."""
        note = body.note if body else None
        check_storable(note, "note")
        return steer_json(store.steering.approve(task_id, actor=actor(body), note=note))

    @app.post("/tasks/{task_id}/reject", tags=["steering"], responses=_ERRORS)
    def reject_task(task_id: uuid.UUID, body: RejectRequest) -> dict[str, Any]:
        """Fail a task held for approval with the note (required, not blank)."""
        check_storable(body.note, "note")
        return steer_json(store.steering.reject(task_id, note=body.note, actor=actor(body)))
