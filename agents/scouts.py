"""The seed's three scouts: competitor scout, market researcher, trend analyst.

Each scout is a leaf of the org chart (it never delegates) and asks the model once: its
prompt (``prompts/<name>.md``) rendered with the goal, its focused question, the CEO's
brief and any context, answered in the scout's model-facing schema. The result is that
answer plus ``offline``, so anything the offline backend produced is labelled as such all
the way up to the report.

Each scout has one tool that works offline: a search of its kind of notes in a small
local table shipped with the package (``agents/data/research_notes.json``; fixed demo
notes, not live research). The model may call it (the tool loop of ``ctx.llm.complete``,
each call a durable step); the notes it returned are kept in the result's
``tool_notes``.

A scout can also be run on its own (``orgchart run "..." --agent trend_analyst``): the
payload ``{"goal": ...}`` is enough, and the scout then asks its default question.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, Field

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
    complete_with_reply,
    task_input,
)
from agents.tools import Tool

#: The local notes the scouts' tools search (a fixed table shipped with the package).
NOTES_FILE = Path(__file__).resolve().parent / "data" / "research_notes.json"
#: Rounds of tool calls a scout allows its model.
SCOUT_TOOL_ROUNDS = 3
#: Notes one search returns at most.
NOTES_PER_SEARCH = 3


class NotesQuery(BaseModel):
    """A search of the local notes: a few words about what to look for."""

    query: str = Field(min_length=1, max_length=300, description="Words to look for")


@functools.cache
def _notes() -> list[dict[str, str]]:
    return list(json.loads(NOTES_FILE.read_text(encoding="utf-8"))["notes"])


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) >= 3}


def search_notes(kind: str, query: str) -> list[dict[str, str]]:
    """The local notes of ``kind`` that share the most words with ``query``, best first."""
    wanted = _words(query)
    scored = []
    for n, note in enumerate(_notes()):
        if note["kind"] != kind:
            continue
        overlap = len(wanted & _words(f"{note['topic']} {note['note']}"))
        if overlap:
            scored.append((-overlap, n, note))
    return [{"topic": note["topic"], "note": note["note"], "source": note["source"]}
            for _, _, note in sorted(scored)[:NOTES_PER_SEARCH]]


def notes_tool(kind: str, what: str) -> Tool:
    """The tool that searches one kind of local notes."""
    return Tool(f"search_{kind}_notes",
                f"Search the local notes about {what} (a small fixed table shipped with "
                "orgchart, not live research). Returns up to three notes with their source.",
                NotesQuery, functools.partial(search_notes, kind))


def tool_notes(reply: Any) -> list[str]:
    """The notes a reply's tool calls returned, as ``topic: note (source)`` lines."""
    lines = []
    for outcome in getattr(reply, "tool_results", ()) or ():
        for note in outcome.result or () if isinstance(outcome.result, list) else ():
            lines.append(f"{note['topic']}: {note['note']} ({note['source']})")
    return list(dict.fromkeys(lines))[:8]


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
        """Ask the model the scout's question (its tool at hand); return its findings."""
        request = task_input(task, ScoutRequest)
        prompt = ctx.prompt(self.prompt_name or self.name, **self.prompt_variables(request))
        options = {"tools": ctx.tools, "max_tool_rounds": SCOUT_TOOL_ROUNDS} if ctx.tools else {}
        findings, offline, reply = complete_with_reply(ctx, prompt, self.findings_model,
                                                      **options)
        output = self.output_model.model_validate({**findings.model_dump(), "offline": offline,
                                                   "tool_notes": tool_notes(reply)})
        ctx.log.info("scout answered", extra={"task_id": str(task.id), "agent": self.name,
                                              "offline": offline})
        return Result(output.model_dump(mode="json"))


class CompetitorScout(Scout):
    """Finds the competitors that matter for the goal and rates the threat of each."""

    name = "competitor_scout"
    tools = (notes_tool("competitor", "competing products and companies"),)
    findings_model = CompetitorFindings
    output_model = CompetitorReport
    default_question = (
        "Which companies, products or substitutes compete for this goal, how does each "
        "position itself, and how much of a threat is each?"
    )


class MarketResearcher(Scout):
    """Estimates the market behind the goal: its size, segments and drivers."""

    name = "market_researcher"
    tools = (notes_tool("market", "markets, buyers and segments"),)
    findings_model = MarketFindings
    output_model = MarketReport
    default_question = (
        "How large is the market this goal addresses, which segments does it split into, "
        "and what drives its growth or decline?"
    )


class TrendAnalyst(Scout):
    """Names the trends that bear on the goal, their direction and the evidence."""

    name = "trend_analyst"
    tools = (notes_tool("trend", "technology and market trends"),)
    findings_model = TrendFindings
    output_model = TrendReport
    default_question = (
        "Which technology, customer and regulatory trends bear on this goal, which way is "
        "each moving, and what is the evidence?"
    )
