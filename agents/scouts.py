"""The seed's three scouts: competitor scout, market researcher, trend analyst.

Each scout is a leaf of the org chart (it never delegates) and makes exactly one model
call: its prompt (``prompts/<name>.md``) rendered with the goal, its focused question,
the CEO's brief and any context, answered in the scout's model-facing schema. The
result is that answer plus ``offline``, so anything the offline backend produced is
labelled as such all the way up to the report.

A scout can also be run on its own (``orgchart run "..." --agent trend_analyst``): the
payload ``{"goal": ...}`` is enough, and the scout then asks its default question.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from agents.base import Agent, Result, TaskView
from agents.context import AgentContext
from agents.schemas import (
    CompetitorFindings,
    CompetitorReport,
    MarketFindings,
    MarketReport,
    ScoutRequest,
    TrendFindings,
    TrendReport,
    as_json,
    complete_as,
    task_input,
)


class Scout(Agent):
    """A leaf researcher: one prompt, one model call, one structured answer.

    Subclasses set ``name``, ``findings_model`` (the model-facing schema),
    ``output_model`` (the findings plus ``offline``) and ``default_question``.
    """

    register = False
    types = ("research",)
    input_model = ScoutRequest
    findings_model: ClassVar[type[BaseModel]]
    default_question: ClassVar[str] = ""

    def prompt_variables(self, request: ScoutRequest) -> dict[str, str]:
        """Return the variables the scout's prompt is rendered with."""
        return {
            "goal": request.goal,
            "question": request.question or self.default_question,
            "brief": request.brief or "(no brief: use the goal alone)",
            "context": as_json(request.context),
        }

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        """Ask the model the scout's question; return its findings labelled online/offline."""
        request = task_input(task, ScoutRequest)
        prompt = ctx.prompt(self.prompt_name or self.name, **self.prompt_variables(request))
        findings, offline = complete_as(ctx, prompt, self.findings_model)
        output = self.output_model.model_validate({**findings.model_dump(), "offline": offline})
        ctx.log.info("scout answered", extra={"task_id": str(task.id), "agent": self.name,
                                              "offline": offline})
        return Result(output.model_dump(mode="json"))


class CompetitorScout(Scout):
    """Finds the competitors that matter for the goal and rates the threat of each."""

    name = "competitor_scout"
    findings_model = CompetitorFindings
    output_model = CompetitorReport
    default_question = (
        "Which companies, products or substitutes compete for this goal, how does each "
        "position itself, and how much of a threat is each?"
    )


class MarketResearcher(Scout):
    """Estimates the market behind the goal: its size, segments and drivers."""

    name = "market_researcher"
    findings_model = MarketFindings
    output_model = MarketReport
    default_question = (
        "How large is the market this goal addresses, which segments does it split into, "
        "and what drives its growth or decline?"
    )


class TrendAnalyst(Scout):
    """Names the trends that bear on the goal, their direction and the evidence."""

    name = "trend_analyst"
    findings_model = TrendFindings
    output_model = TrendReport
    default_question = (
        "Which technology, customer and regulatory trends bear on this goal, which way is "
        "each moving, and what is the evidence?"
    )
