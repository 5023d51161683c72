"""The pydantic models of the built-in org, and the helper that turns a reply into one.

Each agent has an input model (what its task's payload must hold) and an output model
(its result, checked by the output-schema policy). Where a model writes the answer, the
output model extends a *model-facing* part: the part sent to the model as the
structured-output schema (``ctx.llm.complete(prompt, schema=...)``, Ollama's ``format``).
Fields the runtime knows better than the model (``offline``, ``sources``, ``gaps``) are
added by the agent, never asked of the model.

Model-facing parts have every field required and bounded (lengths, item counts, enums),
so a small local model gets a tight ``format`` and the offline backend's schema-valid
answers stay small. Agents accept any schema-valid answer: lists may be empty and strings
arbitrary.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.base import AgentError, TaskView

if TYPE_CHECKING:
    from agents.context import AgentContext

GOAL_MAX_CHARS = 4000
BRIEF_MAX_CHARS = 4000
QUESTION_MAX_CHARS = 1000

Goal = Annotated[str, Field(min_length=1, max_length=GOAL_MAX_CHARS,
                            description="The root goal, in the submitter's words")]
Line = Annotated[str, Field(max_length=400)]
Name = Annotated[str, Field(min_length=1, max_length=200)]

M = TypeVar("M", bound=BaseModel)


class _Input(BaseModel):
    """Inputs refuse unknown keys: a typo in a payload is an error, not a silent no-op."""

    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------- inputs
class GoalRequest(_Input):
    """The CEO's input: a free-text goal and optional context."""

    goal: Goal
    context: dict[str, Any] | None = None


class ResearchRequest(_Input):
    """The intel director's input: the goal and the CEO's brief."""

    goal: Goal
    brief: str = Field("", max_length=BRIEF_MAX_CHARS,
                       description="What intelligence the CEO needs and why")
    context: dict[str, Any] | None = None


class ScoutRequest(_Input):
    """A scout's input: the goal, one focused question and the brief it serves."""

    goal: Goal
    question: str = Field("", max_length=QUESTION_MAX_CHARS,
                          description="The focused question (empty: the scout's default)")
    brief: str = Field("", max_length=BRIEF_MAX_CHARS)
    context: dict[str, Any] | None = None


# ---------------------------------------------------------------------------- ceo
class Plan(BaseModel):
    """Model-facing: what intelligence the CEO needs before it can answer the goal."""

    brief: str = Field(min_length=1, max_length=1500,
                       description="Two to five sentences: what must be found out, and why")
    priorities: list[Annotated[str, Field(max_length=200)]] = Field(
        max_length=5, description="The most important questions, most important first")


class ReportDraft(BaseModel):
    """Model-facing: the final report on the goal."""

    summary: str = Field(min_length=1, max_length=2000, description="The answer in a paragraph")
    findings: list[Line] = Field(max_length=10, description="What the research found")
    recommendations: list[Line] = Field(max_length=8, description="What to do next")


class Report(ReportDraft):
    """The CEO's result: the report, which agents contributed, and whether it is offline."""

    sources: list[str] = Field(description="The agents whose results fed this report")
    gaps: list[str] = Field(default_factory=list,
                            description="Research that failed and is missing from the report")
    offline: bool = Field(description="True when any part came from the offline backend")


# ---------------------------------------------------------------------------- director
class IntelDraft(BaseModel):
    """Model-facing: the director's merge of its scouts' findings."""

    summary: str = Field(min_length=1, max_length=2000,
                         description="What the scouts found, merged, in a paragraph")
    key_points: list[Line] = Field(max_length=10, description="The points the CEO must know")
    open_questions: list[Line] = Field(max_length=5,
                                       description="What is still unknown or contradictory")


class IntelBrief(IntelDraft):
    """The intel director's result."""

    sources: list[str] = Field(description="The scouts whose results were merged")
    gaps: list[str] = Field(default_factory=list,
                            description="Scouts that failed, with their errors")
    findings: dict[str, Any] = Field(default_factory=dict,
                                     description="Each successful scout's result, by child key")
    offline: bool


# ---------------------------------------------------------------------------- scouts
class Competitor(BaseModel):
    """One competitor."""

    name: Name
    positioning: str = Field(max_length=500, description="How it positions itself")
    threat: Literal["low", "medium", "high"]


class CompetitorFindings(BaseModel):
    """Model-facing: the competitor scout's answer."""

    competitors: list[Competitor] = Field(max_length=8)
    notes: str = Field(max_length=1500, description="Anything else worth knowing")


class CompetitorReport(CompetitorFindings):
    """The competitor scout's result."""

    offline: bool
    tool_notes: list[str] = Field(default_factory=list, max_length=8,
                                  description="What the scout's notes tool returned")


class MarketFindings(BaseModel):
    """Model-facing: the market researcher's answer."""

    market_size_estimate: str = Field(
        max_length=300, description="A size estimate with its unit, year and basis")
    segments: list[Annotated[str, Field(max_length=200)]] = Field(max_length=8)
    drivers: list[Annotated[str, Field(max_length=300)]] = Field(max_length=8)


class MarketReport(MarketFindings):
    """The market researcher's result."""

    offline: bool
    tool_notes: list[str] = Field(default_factory=list, max_length=8,
                                  description="What the scout's notes tool returned")


class Trend(BaseModel):
    """One trend."""

    name: Name
    direction: Literal["rising", "stable", "declining"]
    evidence: str = Field(max_length=500, description="What shows the trend")


class TrendFindings(BaseModel):
    """Model-facing: the trend analyst's answer."""

    trends: list[Trend] = Field(max_length=8)


class TrendReport(TrendFindings):
    """The trend analyst's result."""

    offline: bool
    tool_notes: list[str] = Field(default_factory=list, max_length=8,
                                  description="What the scout's notes tool returned")


# ---------------------------------------------------------------------------- helpers
def _problems(exc: ValidationError, limit: int = 5) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}"
        for e in exc.errors()[:limit]
    )


def task_input(task: TaskView, model: type[M]) -> M:
    """Return the task's input: ``task.input`` when the runtime set it, else the payload.

    Raises:
        AgentError: the payload does not match ``model`` (errors named).

    """
    if isinstance(task.input, model):
        return task.input
    try:
        return model.model_validate(task.payload)
    except ValidationError as exc:
        raise AgentError(
            f"{task.agent}: payload does not match {model.__name__}: {_problems(exc)}"
        ) from None


def is_offline(ctx: AgentContext, reply: Any) -> bool:
    """Tell whether ``reply`` (or the whole context) comes from the offline backend."""
    return (bool(ctx.offline) or bool(getattr(reply, "offline", False))
            or getattr(reply, "backend", None) == "offline")


def complete_as(ctx: AgentContext, prompt: str, schema: type[M]) -> tuple[M, bool]:
    """Ask the model for a ``schema`` instance; return it and whether it is offline.

    Raises:
        AgentError: the answer is not valid for ``schema`` (the task ends ``failed``
            with the validation errors named).

    """
    value, offline, _ = complete_with_reply(ctx, prompt, schema)
    return value, offline


def complete_with_reply(ctx: AgentContext, prompt: str, schema: type[M],
                        **options: Any) -> tuple[M, bool, Any]:
    """:func:`complete_as`, with ``complete``'s options (``tools=``...) and its reply."""
    reply = ctx.llm.complete(prompt, schema=schema, **options)
    output = getattr(reply, "output", None)
    if isinstance(output, schema):  # validated once, by the model layer
        return output, is_offline(ctx, reply), reply
    data = getattr(reply, "data", None)
    if data is None:
        text = getattr(reply, "text", "") or ""
        try:
            data = json.loads(text)
        except ValueError:
            raise AgentError(
                f"{ctx.task.agent}: the model's answer is not JSON for {schema.__name__}: "
                f"{text[:200]!r}"
            ) from None
    try:
        value = schema.model_validate(data)
    except ValidationError as exc:
        raise AgentError(
            f"{ctx.task.agent}: the model's answer does not match {schema.__name__}: "
            f"{_problems(exc)}"
        ) from None
    return value, is_offline(ctx, reply), reply


def as_json(value: Any) -> str:
    """Render a value for a prompt: one-line JSON (indentation costs tokens), or ``none``."""
    if value is None:
        return "none"
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def result_offline(result: Any) -> bool:
    """Tell whether a child's result says it was produced offline."""
    return isinstance(result, dict) and bool(result.get("offline"))
