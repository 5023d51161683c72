"""The intel director: fans a research brief out to three scouts and merges their answers.

``run`` makes no model call: it turns the goal and the CEO's brief into three focused
questions (one per scout) and delegates them in parallel under the keys
``competitors``, ``market`` and ``trends``, budgets left to the runtime to carve evenly
from what the director has left. Keeping ``run`` deterministic means a re-run after a
crash asks for exactly the children it asked for before.

``aggregate`` merges the scouts' results into an :class:`~agents.schemas.IntelBrief`
with one model call. It tolerates one failed (or escalated) scout, noting the gap in
``gaps``; with two or more scouts missing there is too little to merge, so it escalates
with every scout's error named.
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
    RetryChildren,
    TaskView,
)
from agents.context import AgentContext
from agents.schemas import (
    IntelBrief,
    IntelDraft,
    ResearchRequest,
    as_json,
    complete_as,
    result_offline,
    task_input,
)

#: Child key -> (scout agent, question). ``{topic}`` is the goal's first line, quoted.
SCOUTS: dict[str, tuple[str, str]] = {
    "competitors": (
        "competitor_scout",
        "Who competes with us on {topic}? Name the competitors that matter, how each "
        "positions itself, and how much of a threat each is.",
    ),
    "market": (
        "market_researcher",
        "How large is the market for {topic}? Estimate its size, split it into segments, "
        "and name what drives it.",
    ),
    "trends": (
        "trend_analyst",
        "Which trends bear on {topic}? For each, say which way it is moving and what "
        "shows it.",
    ),
}

#: How many scouts may fail before the director escalates instead of merging.
MAX_FAILED_SCOUTS = 1
TOPIC_MAX_CHARS = 200


def topic_of(goal: str) -> str:
    """Quote the goal's first non-empty line, shortened to fit in a question."""
    line = next((ln.strip() for ln in goal.splitlines() if ln.strip()), goal.strip())
    line = line.rstrip(" .?!")
    if len(line) > TOPIC_MAX_CHARS:
        line = line[: TOPIC_MAX_CHARS - 1].rstrip() + "…"
    return f'"{line}"'


def child_label(child: ChildView) -> str:
    """How a child is named in gaps and errors: ``market_researcher (market)``."""
    return f"{child.agent} ({child.key})" if child.key else child.agent


class IntelDirector(Agent):
    """Runs the research: three scouts in parallel, their findings merged into a brief."""

    name = "intel_director"
    types = ("research",)
    input_model = ResearchRequest
    output_model = IntelBrief
    delegates_to = ("competitor_scout", "market_researcher", "trend_analyst")

    def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        """Delegate one focused question to each scout, in parallel."""
        request = task_input(task, ResearchRequest)
        topic = topic_of(request.goal)
        children = []
        for key, (agent, question) in SCOUTS.items():
            payload: dict[str, Any] = {
                "goal": request.goal,
                "question": question.format(topic=topic),
                "brief": request.brief,
            }
            if request.context is not None:
                payload["context"] = request.context
            children.append(ChildSpec(agent=agent, type="research", key=key, payload=payload))
        return Delegate(children, note=f"research fanned out to {len(children)} scouts")

    def aggregate(self, ctx: AgentContext, task: TaskView,
                  children: list[ChildView]) -> Result | Escalate | RetryChildren:
        """Merge the scouts' findings; tolerate one missing scout.

        With more missing, failed scouts are retried once, then the director escalates.
        """
        request = task_input(task, ResearchRequest)
        done = [c for c in children if c.ok]
        missing = [c for c in children if not c.ok]
        gaps = [f"{child_label(c)} {c.status}: {c.error or 'no error given'}" for c in missing]
        if len(missing) > MAX_FAILED_SCOUTS or not done:
            # Too few to merge. Scouts that failed (not escalated: those wait for a
            # person) get one more try before the director gives up.
            again = [c.id for c in missing if c.status == "failed" and c.retries == 0]
            if again:
                return RetryChildren(again, note=f"retrying {len(again)} failed scout(s) once")
            return Escalate(
                f"{len(missing)} of {len(children)} scouts did not succeed, too few to merge: "
                + "; ".join(gaps)
            )
        findings = {c.key or c.agent: c.result for c in done}
        prompt = ctx.prompt(
            self.prompt_name or self.name,
            goal=request.goal,
            brief=request.brief or "(no brief: use the goal alone)",
            findings=as_json(findings),
            gaps="\n".join(f"- {g}" for g in gaps) or "none: every scout answered",
        )
        draft, offline = complete_as(ctx, prompt, IntelDraft)
        brief = IntelBrief(
            **draft.model_dump(),
            sources=sorted(c.agent for c in done),
            gaps=gaps,
            findings=findings,
            offline=offline or any(result_offline(c.result) for c in done),
        )
        if gaps:
            ctx.log.warning("research merged with a gap",
                            extra={"task_id": str(task.id), "gaps": gaps})
        return Result(brief.model_dump(mode="json"))
