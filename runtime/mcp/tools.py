"""The MCP tools: each one a thin call into the code the CLI and the HTTP API run.

Every tool's input schema is a pydantic model built on the HTTP API's request model
(``SubmitRequest``, ``NoteRequest``, ``AnswerRequest``, ``ForkRequest``) plus the id the
API takes from its path, so the three faces accept the same fields. Arguments are
validated before anything is read or written: bad input raises :class:`ToolRefused`
with the message the CLI prints after ``error:`` (an unknown task, a malformed id, an
answer that does not fit its question), and nothing changes.

The functions here block (they use the store); :mod:`runtime.mcp.server` runs them in
worker threads.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.registry import Registry, UnknownAgent
from runtime.config import Settings
from runtime.core.dberrors import refused_value
from runtime.errors import BadInput
from runtime.forks import fork
from runtime.http.api import SubmitRequest
from runtime.http.forks import ForkRequest
from runtime.http.messages import validation_message
from runtime.http.steering import AnswerRequest, NoteRequest
from runtime.store.rows import IdempotencyConflict, NotFound, ResolveRefused
from runtime.store.steering import SteeringRefused
from runtime.store.store import Store
from runtime.views import (
    inbox_json,
    parse_task_id,
    steer_json,
    task_detail_json,
    task_json,
    tree_text,
)
from runtime.wiring import build_root, check_storable, submit_root

#: Who a steering tool acts as when the call names nobody (``by``).
DEFAULT_ACTOR = "mcp"
#: Errors that mean "the input is wrong": the tool answers isError with the message.
REFUSED_ERRORS: tuple[type[BaseException], ...] = (
    BadInput, UnknownAgent, IdempotencyConflict, ResolveRefused, NotFound, SteeringRefused,
)


class ToolRefused(Exception):
    """A tool call refused for bad input; nothing changed. The message says why."""


# ---------------------------------------------------------------------- input models
class TaskRef(BaseModel):
    """A task named by id (the HTTP API's path parameter)."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(..., description="The task's id (a UUID).")


class RootRef(BaseModel):
    """A tree named by its root's id."""

    model_config = ConfigDict(extra="forbid")

    root_id: str = Field(..., description="The root task's id (a UUID).")


class SubmitGoalArgs(SubmitRequest):
    """``POST /tasks``'s body, its ``Idempotency-Key`` header, and whether to wait."""

    idempotency_key: str | None = Field(
        None, description="A repeat with the same key returns the same task.")
    wait: bool = Field(False, description="Wait until the tree ends (or the timeout), "
                                          "with progress notifications.")
    timeout_seconds: float = Field(300, gt=0, le=3600, description="With wait: how long.")


class GetTreeArgs(RootRef):
    """``GET /trees/{root_id}``: the tree, summary shape by default."""

    fields: Literal["full", "summary"] = Field(
        "summary", description="'summary' leaves out payloads, results and verdicts.")
    under: str | None = Field(None, description="Only this task's subtree.")
    depth: int | None = Field(None, ge=0, description="Only this many levels below the top.")


class GetTaskArgs(TaskRef):
    """``GET /tasks/{id}``: one task with its history and children."""

    model_calls: bool = Field(False, description="Include the recorded model calls.")


class NoArgs(BaseModel):
    """No arguments."""

    model_config = ConfigDict(extra="forbid")


class TaskNoteArgs(TaskRef, NoteRequest):
    """A task and the note kept in its history."""


class RootNoteArgs(RootRef, NoteRequest):
    """A tree and the note kept in its history."""


class AnswerArgs(TaskRef, AnswerRequest):
    """``POST /tasks/{id}/answer``."""


class ForkArgs(TaskRef, ForkRequest):
    """``POST /tasks/{id}/fork``."""


# ---------------------------------------------------------------------- the calls
@dataclass(frozen=True)
class Deps:
    """What the tools call into: the store, the agents, the configuration."""

    store: Store
    registry: Registry
    settings: Settings


def _by(args: NoteRequest | AnswerRequest) -> str:
    check_storable(args.by, "by")
    return args.by or DEFAULT_ACTOR


def submit_goal(deps: Deps, args: SubmitGoalArgs) -> dict[str, Any]:
    """Submit a root goal (``orgchart submit``, ``POST /tasks``)."""
    new = build_root(
        deps.registry, deps.settings, goal=args.prompt, agent=args.agent, type_=args.type,
        priority=args.priority, budget_tokens=args.budget_tokens,
        budget_seconds=args.budget_seconds, budget_usd=args.budget_usd,
        payload=args.payload, success=args.success_criteria, kill=args.kill_criteria,
        idempotency_key=args.idempotency_key, tenant=args.tenant,
    )
    task, created = submit_root(deps.store, new, DEFAULT_ACTOR,
                                deps.settings.database.failover_timeout_seconds)
    warning = deps.store.claims.no_worker_warning(
        new.to_agent, deps.settings.worker.maintenance_interval_seconds)
    return {**task_json(task), "created": created, **({"warning": warning} if warning else {})}


def get_tree(deps: Deps, args: GetTreeArgs) -> str:
    """The tree under a root (``orgchart tree``, ``GET /trees/{root_id}``), as JSON text."""
    under = parse_task_id(args.under, "under") if args.under is not None else None
    text, _ = tree_text(deps.store, parse_task_id(args.root_id, "root id"), under,
                        args.depth, args.fields)
    return text


def get_task(deps: Deps, args: GetTaskArgs) -> dict[str, Any]:
    """One task with its history (``orgchart show``, ``GET /tasks/{id}``)."""
    return task_detail_json(deps.store, parse_task_id(args.task_id),
                            model_calls=args.model_calls)


def list_inbox(deps: Deps, _: NoArgs) -> dict[str, Any]:
    """What waits for a person (``orgchart inbox``, ``GET /inbox``)."""
    return {"items": [inbox_json(r) for r in deps.store.steering.inbox()]}


def answer(deps: Deps, args: AnswerArgs) -> dict[str, Any]:
    """Answer a question to ``human`` (``orgchart answer``)."""
    tid = parse_task_id(args.task_id)
    check_storable(args.answer, "the answer")
    return steer_json(deps.store.steering.answer(tid, args.answer, actor=_by(args)))


def approve(deps: Deps, args: TaskNoteArgs) -> dict[str, Any]:
    """Let a task held for approval run (``orgchart approve``)."""
    tid = parse_task_id(args.task_id)
    check_storable(args.note, "note")
    return steer_json(deps.store.steering.approve(tid, actor=_by(args), note=args.note))


def reject(deps: Deps, args: TaskNoteArgs) -> dict[str, Any]:
    """Fail a task held for approval with the note (``orgchart reject``)."""
    tid = parse_task_id(args.task_id)
    check_storable(args.note, "note")
    return steer_json(deps.store.steering.reject(tid, note=args.note or "", actor=_by(args)))


def cancel(deps: Deps, args: TaskNoteArgs) -> dict[str, Any]:
    """Cancel a task and its open subtree (``orgchart cancel``)."""
    tid = parse_task_id(args.task_id)
    check_storable(args.note, "note")
    return steer_json(deps.store.steering.cancel(tid, actor=_by(args), note=args.note))


def pause(deps: Deps, args: RootNoteArgs) -> dict[str, Any]:
    """Pause a tree (``orgchart pause``)."""
    rid = parse_task_id(args.root_id, "root id")
    check_storable(args.note, "note")
    return steer_json(deps.store.steering.pause(rid, actor=_by(args), note=args.note))


def resume(deps: Deps, args: RootNoteArgs) -> dict[str, Any]:
    """Resume a paused tree (``orgchart resume``)."""
    rid = parse_task_id(args.root_id, "root id")
    return steer_json(deps.store.steering.resume(rid, actor=_by(args)))


def fork_task(deps: Deps, args: ForkArgs) -> dict[str, Any]:
    """Fork a tree at a task (``orgchart fork``, ``POST /tasks/{id}/fork``)."""
    tid = parse_task_id(args.task_id)
    overrides = args.model_dump(exclude_none=True, exclude={"task_id"})
    branch = fork(deps.store, deps.registry, deps.settings, tid, actor=DEFAULT_ACTOR,
                  **overrides)
    return {**task_json(branch), "created": True}


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its name, what it does, its input model and the call."""

    name: str
    description: str
    model: type[BaseModel]
    call: Callable[[Deps, Any], Any]
    read_only: bool = False


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("submit_goal", "Submit a root goal to an agent (default 'ceo'). With wait, "
             "return when the tree ends, sending progress notifications.",
             SubmitGoalArgs, submit_goal),
    ToolSpec("get_tree", "A task tree under its root, nested, with totals (summary shape "
             "by default).", GetTreeArgs, get_tree, read_only=True),
    ToolSpec("get_task", "One task with its history, children and steps.",
             GetTaskArgs, get_task, read_only=True),
    ToolSpec("list_inbox", "What waits for a person, oldest first: questions, approvals, "
             "escalations.", NoArgs, list_inbox, read_only=True),
    ToolSpec("answer", "Answer a question to 'human' (checked against its schema or "
             "choices).", AnswerArgs, answer),
    ToolSpec("approve", "Let a task held for approval run (once).", TaskNoteArgs, approve),
    ToolSpec("reject", "Fail a task held for approval, with a note (required).",
             TaskNoteArgs, reject),
    ToolSpec("cancel", "Cancel a task and every open task below it.", TaskNoteArgs, cancel),
    ToolSpec("pause", "Pause a tree: no claims, no new model calls until resumed.",
             RootNoteArgs, pause),
    ToolSpec("resume", "Resume a paused tree where it stood.", RootNoteArgs, resume),
    ToolSpec("fork", "Fork a tree at a task: a new tree re-runs it with the overrides "
             "there (none: a re-run).", ForkArgs, fork_task),
)
TOOLS_BY_NAME = {t.name: t for t in TOOLS}


def parse_arguments(spec: ToolSpec, arguments: dict[str, Any] | None) -> BaseModel:
    """Validate a call's arguments against the tool's model.

    Raises:
        ToolRefused: one readable line per problem (as the HTTP API's 422 says it).

    """
    try:
        args = spec.model.model_validate(arguments or {})
    except ValidationError as exc:
        errors = [{**e, "loc": ("arguments", *e.get("loc", ()))} for e in exc.errors()]
        raise ToolRefused(validation_message(RequestValidationError(errors))) from None
    try:
        check_storable(args.model_dump(mode="python"), "arguments")
    except BadInput as exc:
        raise ToolRefused(str(exc)) from None
    return args


def run_tool(deps: Deps, spec: ToolSpec, args: BaseModel) -> Any:
    """Run one tool call (blocking); bad input becomes :class:`ToolRefused`."""
    try:
        return spec.call(deps, args)
    except REFUSED_ERRORS as exc:
        raise ToolRefused(str(exc)) from None
    except sa.exc.DataError as exc:
        refused = refused_value(exc) or "invalid data"
        raise ToolRefused(f"the database refused a value: {refused}") from None


def root_progress(store: Store, root_id: uuid.UUID) -> tuple[str, int, int]:
    """A tree's root status, how many of its tasks have ended, and how many it has."""
    from runtime.store.rows import TERMINAL_STATUSES

    rows = store.reads.tree_rows(root_id)
    status = next(str(r["status"]) for r in rows if r["id"] == root_id)
    ended = sum(1 for r in rows if r["status"] in TERMINAL_STATUSES)
    return status, ended, len(rows)
