"""Agents used only by the benchmarks (``--agents-module bench.agents``).

``stamp`` records the wall-clock time at which its ``run`` starts, so the pickup
benchmark can measure submit-commit -> agent start on one machine's clock.

``mk_planner`` -> ``mk_lead`` -> ``mk_writer`` is the makespan tree (``bench.makespan``):
``async def`` agents whose only waits are model calls; the critical path is a writer's
call then the planner's aggregate call.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from agents.base import Agent, ChildSpec, ChildView, Delegate, Result, TaskView
from agents.context import AgentContext


class StampInput(BaseModel):
    """Any payload."""

    model_config = ConfigDict(extra="allow")
    goal: str = ""


class StampOutput(BaseModel):
    """When the agent started (``time.time()``)."""

    model_config = ConfigDict(extra="allow")
    started: float


class AnyResult(BaseModel):
    """Any result."""

    model_config = ConfigDict(extra="allow")


class Stamp(Agent):
    """Returns the time its run started."""

    name = "stamp"
    input_model = StampInput
    output_model = StampOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        return Result({"started": time.time()})


# ---------------------------------------------------------------------- makespan
class _Simulated:
    text = "simulated"


async def model_call(ctx: AgentContext, prompt: str, max_tokens: int = 8) -> Any:
    """``await ctx.llm.acomplete(...)``.

    With ``simulate`` (seconds) in the task's payload, no model is called: the agent just
    waits that long (the engine's own share of the makespan, without the model layer).
    """
    simulate = ctx.task.payload.get("simulate")
    if simulate:
        await asyncio.sleep(float(simulate))
        return _Simulated()
    return await ctx.llm.acomplete(prompt, max_tokens=max_tokens)


class MakespanPlanner(Agent):
    """Delegates ``leads`` leads; aggregates with one model call (the critical path's 2nd)."""

    name = "mk_planner"
    input_model = StampInput
    output_model = AnyResult
    delegates_to = ("mk_lead",)

    async def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        leads = int(task.payload.get("leads", 30))
        writers = int(task.payload.get("writers", 30))
        simulate = task.payload.get("simulate")
        pad = "." * int(task.payload.get("pad", 0))  # longer prompts: dearer calls
        return Delegate([ChildSpec("mk_lead", {"goal": f"lead {i}{pad}", "writers": writers,
                                               "simulate": simulate},
                                   key=f"lead-{i}") for i in range(leads)])

    async def aggregate(self, ctx: AgentContext, task: TaskView,
                        children: list[ChildView]) -> Result:
        reply = await model_call(ctx, f"sum up {len(children)} leads")
        return Result({"leads": len(children), "text": reply.text})


class MakespanLead(Agent):
    """Delegates ``writers`` writers; aggregates without a model call."""

    name = "mk_lead"
    input_model = StampInput
    output_model = AnyResult
    delegates_to = ("mk_writer",)

    async def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        return Delegate([ChildSpec("mk_writer", {"goal": f"{task.payload['goal']} part {i}",
                                                 "simulate": task.payload.get("simulate")},
                                   key=f"w-{i}")
                         for i in range(int(task.payload.get("writers", 30)))])

    async def aggregate(self, ctx: AgentContext, task: TaskView,
                        children: list[ChildView]) -> Result:
        return Result({"writers": len(children)})


class MakespanWriter(Agent):
    """One model call (the critical path's 1st)."""

    name = "mk_writer"
    input_model = StampInput
    output_model = AnyResult

    async def run(self, ctx: AgentContext, task: TaskView) -> Result:
        reply = await model_call(ctx, f"write {task.payload['goal']}")
        return Result({"text": reply.text})


class FairRoot(Agent):
    """Delegates ``writers`` writers at once; aggregates with one model call (bench.fairness)."""

    name = "fair_root"
    input_model = StampInput
    output_model = AnyResult
    delegates_to = ("mk_writer",)

    async def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        return Delegate([ChildSpec("mk_writer", {"goal": f"part {i:05d}"}, key=f"w-{i}")
                         for i in range(int(task.payload.get("writers", 3)))])

    async def aggregate(self, ctx: AgentContext, task: TaskView,
                        children: list[ChildView]) -> Result:
        reply = await model_call(ctx, f"sum up {len(children):05d} parts")
        return Result({"writers": len(children), "text": reply.text})


# ---------------------------------------------------------------------- makespan, sync
class SyncMakespanPlanner(Agent):
    """:class:`MakespanPlanner` as a plain ``def`` agent (``bench.sync_agents``)."""

    name = "mks_planner"
    input_model = StampInput
    output_model = AnyResult
    delegates_to = ("mks_lead",)

    def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        leads = int(task.payload.get("leads", 30))
        writers = int(task.payload.get("writers", 30))
        return Delegate([ChildSpec("mks_lead", {"goal": f"lead {i}", "writers": writers},
                                   key=f"lead-{i}") for i in range(leads)])

    def aggregate(self, ctx: AgentContext, task: TaskView, children: list[ChildView]) -> Result:
        reply = ctx.llm.complete(f"sum up {len(children)} leads", max_tokens=8)
        return Result({"leads": len(children), "text": reply.text})


class SyncMakespanLead(Agent):
    """:class:`MakespanLead` as a plain ``def`` agent."""

    name = "mks_lead"
    input_model = StampInput
    output_model = AnyResult
    delegates_to = ("mks_writer",)

    def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        return Delegate([ChildSpec("mks_writer", {"goal": f"{task.payload['goal']} part {i}"},
                                   key=f"w-{i}")
                         for i in range(int(task.payload.get("writers", 30)))])

    def aggregate(self, ctx: AgentContext, task: TaskView, children: list[ChildView]) -> Result:
        return Result({"writers": len(children)})


class SyncMakespanWriter(Agent):
    """:class:`MakespanWriter` as a plain ``def`` agent: one blocking ``ctx.llm.complete``."""

    name = "mks_writer"
    input_model = StampInput
    output_model = AnyResult

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        reply = ctx.llm.complete(f"write {task.payload['goal']}", max_tokens=8)
        return Result({"text": reply.text})


# ---------------------------------------------------------------------- control
class BenchAsker(Agent):
    """Asks a person one question (``bench.control``'s answer_to_parent_ms); returns the answer."""

    name = "bench_asker"
    input_model = StampInput
    output_model = AnyResult

    async def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        return Delegate([ChildSpec("human", {"question": "go ahead?", "choices": ["yes", "no"]},
                                   key="q", budget_seconds=task.budget_seconds)])

    async def aggregate(self, ctx: AgentContext, task: TaskView,
                        children: list[ChildView]) -> Result:
        return Result({"answer": children[0].result})
