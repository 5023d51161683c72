"""The HTTP face of forks and diffs (docs/api.md).

- ``POST /tasks/{id}/fork``: a branch that re-runs the task's tree from its root, with
  the overrides at that task; 201 with the branch's root (``submit``'s shape). A missing
  task is 404; a payload that does not fit the agent's schema, an unknown agent or model
  is 422, and nothing is created.
- ``GET /tasks/{id}/forks``: the branches forked from a root, oldest first.
- ``GET /diff/{a}/{b}``: two trees side by side, task by task (:mod:`runtime.forks.diff`).
- ``GET /ui/diff/{a}/{b}``: the same as a page.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from agents.registry import InvalidInput, Registry, UnknownAgent
from runtime.config import Settings
from runtime.forks import fork
from runtime.forks.diff import diff_trees
from runtime.http.constraints import JsonObject, Text, Tokens, Usd
from runtime.store.store import Store
from runtime.views import task_json

_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"description": "no task with that id"},
    409: {"description": "the task's payload does not fit the agent named, or the payload "
                         "does not fit the task's agent; nothing was created"},
    422: {"description": "bad overrides (the message says which); nothing was created"},
}


def _check_against_task(store: Store, registry: Registry, task_id: uuid.UUID,
                        body: ForkRequest) -> None:
    """Refuse (409) a payload or an agent that does not fit the task's own agent or payload.

    With both given, the document says which payload each agent takes (422 when it does
    not fit); with one, the other is the task's, which the document cannot know.
    """
    if (body.payload is None) == (body.agent is None):
        return
    task = store.reads.get(task_id)
    agent = body.agent or str(task["to_agent"])
    payload = task["payload"] if body.payload is None else body.payload
    try:
        registry.validate_input(agent, payload)
    except InvalidInput as exc:
        raise HTTPException(409, f"the payload does not fit agent {agent!r}: {exc}") from None
    except UnknownAgent:
        return  # fork() says so, with the closest name



class ForkRequest(BaseModel):
    """``POST /tasks/{id}/fork``: the overrides at the task (all optional: none is a re-run)."""

    model_config = ConfigDict(extra="forbid")

    payload: JsonObject | None = Field(
        None, description="The task's new payload (checked against the agent's schema).")
    agent: str | None = Field(None, description="Run the task with this agent.")
    model: str | None = Field(None, description="The model of the task's and its subtree's "
                                                "calls (one with a price).")
    note: Text | None = Field(None, max_length=10_000, description="Kept in the history.")
    budget_tokens: Tokens | None = Field(None, description="Default: the original root's.")
    budget_usd: Usd | None = Field(None, description="Default: the original root's.")


def add_fork_routes(app: FastAPI, store: Store, settings: Settings, registry: Registry,
                    page: Callable[..., HTMLResponse]) -> None:
    """Add the fork and diff endpoints, and the diff page (rendered by ``page``)."""

    @app.post("/tasks/{task_id}/fork", status_code=201, tags=["forks"], responses=_ERRORS)
    def fork_task(task_id: uuid.UUID, body: ForkRequest) -> Response:
        """Fork the task's tree: a new tree re-runs it, with the overrides at this task.

        Every model call of the branch that asks exactly what its counterpart asked is
        served from the record (charged zero); the original tree is never written.
        """
        _check_against_task(store, registry, task_id, body)
        branch = fork(store, registry, settings, task_id, actor="api",
                      **body.model_dump(exclude_none=True))
        return JSONResponse({**task_json(branch), "created": True}, status_code=201,
                            headers={"Location": f"/tasks/{branch['id']}"})

    @app.get("/tasks/{task_id}/forks", tags=["forks"], responses=_ERRORS)
    def list_forks(task_id: uuid.UUID) -> list[dict[str, Any]]:
        """The branches forked from a root, oldest first (id, status, agent, fork)."""
        store.reads.get(task_id)  # 404 for an unknown id
        return [{"id": str(r["id"]), "status": r["status"], "agent": r["to_agent"],
                 "fork": r["fork"], "created_at": r["created_at"].isoformat()}
                for r in store.reads.forks_of(task_id)]

    @app.get("/diff/{root_a}/{root_b}", tags=["forks"], responses=_ERRORS)
    def get_diff(root_a: uuid.UUID, root_b: uuid.UUID) -> dict[str, Any]:
        """Two trees side by side, paired by path of child keys (``orgchart diff``)."""
        return diff_trees(store, root_a, root_b)

    @app.get("/ui/diff/{root_a}/{root_b}", include_in_schema=False)
    def diff_page(root_a: uuid.UUID, root_b: uuid.UUID, request: Request) -> HTMLResponse:
        return page("diff.html", request, a=str(root_a), b=str(root_b))
