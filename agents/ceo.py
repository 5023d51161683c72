"""The CEO: the root of the seed's org. Plans the research, then writes the report.

``run`` asks the model for a short :class:`~agents.schemas.Plan` (what intelligence is
needed and why) and delegates it to the intel director under the key ``intel``.
``aggregate`` turns the director's brief into the final :class:`~agents.schemas.Report`
with a second model call, adding which agents contributed (``sources``), what is
missing (``gaps``) and whether any part came from the offline backend (``offline``).
"""

from __future__ import annotations

from typing import Any

from agents.base import (
    Agent,
    ChildSpec,
    ChildView,
    Delegate,
    Escalate,
    Result,
    TaskView,
)
from agents.context import AgentContext
from agents.schemas import (
    GoalRequest,
    Plan,
    Report,
    ReportDraft,
    as_json,
    complete_as,
    result_offline,
    task_input,
)

INTEL_KEY = "intel"


def brief_text(plan: Plan) -> str:
    """Write the brief for the director: the plan's prose, then its priorities."""
    if not plan.priorities:
        return plan.brief
    return plan.brief + "\nPriorities:\n" + "\n".join(f"- {p}" for p in plan.priorities)


class Ceo(Agent):
    """Turns a goal into a research brief, then the director's findings into a report.

    Failed research is escalated, not retried: retries belong one level down, where the
    director tolerates one missing scout and retries failed scouts once (bounded by
    ``ChildView.retries``). A re-run director would find the same children (unique per
    key) and end the same way. So when the director ends ``failed`` or ``escalated``, the
    CEO escalates with the director's status and error in the reason, and a person
    decides: resolve the root ``done`` or ``failed`` (``orgchart resolve``), or submit the
    goal again.
    """

    name = "ceo"
    types = ("goal",)
    input_model = GoalRequest
    output_model = Report
    delegates_to = ("intel_director",)

    def _prompt(self, ctx: AgentContext, request: GoalRequest, step: str, material: Any) -> str:
        return ctx.prompt(
            self.prompt_name or self.name,
            goal=request.goal,
            context=as_json(request.context),
            step=step,
            material=as_json(material) if material is not None else "(none yet)",
        )

    def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        """Plan the research and delegate it to the intel director."""
        request = task_input(task, GoalRequest)
        plan, _ = complete_as(ctx, self._prompt(ctx, request, "plan", None), Plan)
        payload: dict[str, Any] = {"goal": request.goal, "brief": brief_text(plan)}
        if request.context is not None:
            payload["context"] = request.context
        return Delegate(
            [ChildSpec(agent="intel_director", type="research", key=INTEL_KEY, payload=payload)],
            note="research delegated to the intel director",
        )

    def aggregate(self, ctx: AgentContext, task: TaskView,
                  children: list[ChildView]) -> Result | Escalate:
        """Write the report from the director's brief; escalate when research failed."""
        request = task_input(task, GoalRequest)
        intel = next((c for c in children if c.key == INTEL_KEY), None)
        if intel is None:
            intel = next((c for c in children if c.agent == "intel_director"), None)
        if intel is None:
            return Escalate("the CEO has no intel_director child to report from")
        if not intel.ok:
            return Escalate(
                f"research did not succeed: {intel.agent} {intel.status}: "
                f"{intel.error or 'no error given'}"
            )
        research = intel.result if isinstance(intel.result, dict) else {}
        draft, offline = complete_as(ctx, self._prompt(ctx, request, "report", intel.result),
                                     ReportDraft)
        scouts = [s for s in research.get("sources", []) if isinstance(s, str)]
        gaps = [g for g in research.get("gaps", []) if isinstance(g, str)]
        report = Report(
            **draft.model_dump(),
            sources=[intel.agent, *scouts],
            gaps=gaps,
            offline=offline or result_offline(intel.result),
        )
        return Result(report.model_dump(mode="json"))
