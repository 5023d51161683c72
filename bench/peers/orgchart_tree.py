"""The tree and the chain on orgchart: ``async def`` agents (``--agents-module`` this module).

``pe_planner`` delegates ``leads`` leads, each lead ``writers`` writers; a writer makes one
model call; a lead aggregates without one, the planner with one. ``pe_link`` makes one call,
then delegates the next level; the last level returns its answer, and every aggregate hands
it up. One ``orgchart worker`` runs them; a task is submitted to start the work, and a
SIGKILLed worker's tasks are taken back by the new worker as it starts (PostgreSQL ended
the dead one's session: docs/operations.md), not when their leases expire (the model
calls already recorded are replayed, not made again).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict

from agents.base import Agent, ChildSpec, ChildView, Delegate, Result, TaskView
from agents.context import AgentContext
from bench.peers.shape import Shape, link_prompt, planner_prompt, writer_prompt
from runtime.store.rows import NewTask


class Payload(BaseModel):
    """Any payload, any result."""

    model_config = ConfigDict(extra="allow")


class Planner(Agent):
    """Delegates the leads; aggregates with one model call."""

    name = "pe_planner"
    input_model = output_model = Payload
    delegates_to = ("pe_lead",)

    async def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        writers = task.payload["writers"]
        return Delegate([ChildSpec("pe_lead", {"lead": i, "writers": writers}, key=f"l{i}")
                         for i in range(task.payload["leads"])])

    async def aggregate(self, ctx: AgentContext, task: TaskView,
                        children: list[ChildView]) -> Result:
        reply = await ctx.llm.acomplete(planner_prompt(len(children)), max_tokens=8)
        return Result({"leads": len(children), "text": reply.text})


class Lead(Agent):
    """Delegates the writers; aggregates without a model call."""

    name = "pe_lead"
    input_model = output_model = Payload
    delegates_to = ("pe_writer",)

    async def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        lead = task.payload["lead"]
        return Delegate([ChildSpec("pe_writer", {"lead": lead, "part": j}, key=f"w{j}")
                         for j in range(task.payload["writers"])])

    async def aggregate(self, ctx: AgentContext, task: TaskView,
                        children: list[ChildView]) -> Result:
        return Result({"writers": len(children)})


class Writer(Agent):
    """One model call."""

    name = "pe_writer"
    input_model = output_model = Payload

    async def run(self, ctx: AgentContext, task: TaskView) -> Result:
        prompt = writer_prompt(task.payload["lead"], task.payload["part"])
        reply = await ctx.llm.acomplete(prompt, max_tokens=8)
        return Result({"text": reply.text})


class Link(Agent):
    """One level of the chain: one model call, then the next level."""

    name = "pe_link"
    input_model = output_model = Payload
    delegates_to = ("pe_link",)

    async def run(self, ctx: AgentContext, task: TaskView) -> Delegate | Result:
        level, depth = task.payload["level"], task.payload["depth"]
        reply = await ctx.llm.acomplete(link_prompt(level), max_tokens=8)
        if level >= depth:
            return Result({"text": reply.text})
        # a child without a budget gets half of what is left: 50 levels would run dry
        return Delegate([ChildSpec("pe_link", {"level": level + 1, "depth": depth}, key="next",
                                   budget_tokens=task.budget_tokens - 100,
                                   budget_usd=task.budget_usd - Decimal("0.01"))])

    async def aggregate(self, ctx: AgentContext, task: TaskView,
                        children: list[ChildView]) -> Result:
        return Result(children[0].result)


def root_task(shape: Shape) -> NewTask:
    """The task that starts the work."""
    payload: dict[str, Any] = ({"leads": shape.leads, "writers": shape.writers}
                               if shape.kind == "tree" else {"level": 1, "depth": shape.depth})
    return NewTask(to_agent="pe_planner" if shape.kind == "tree" else "pe_link", type="task",
                   payload=payload, budget_tokens=10_000_000, budget_usd=Decimal(1000))
