"""A planner with writers, for fork tests and ``bench.fork``.

The planner delegates one writer per part (keys ``w0``, ``w1``, ...); each writer makes
one model call about its part; the planner's aggregate makes one more call that quotes
the writers' answers. A writer whose payload says ``fail`` fails without a call; one
that says ``sleep`` sleeps first (a tree still running when it is forked).
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from agents.base import Agent, ChildSpec, ChildView, Delegate, Fail, Result, TaskView
from agents.context import AgentContext


class PlanInput(BaseModel):
    """The planner's goal and how many writers."""

    model_config = ConfigDict(extra="forbid")
    goal: str
    parts: int = 3
    fail_part: int | None = None
    sleep: float = 0.0


class WriterInput(BaseModel):
    """A writer's part."""

    model_config = ConfigDict(extra="forbid")
    goal: str
    fail: bool = False
    sleep: float = 0.0


class AnyOutput(BaseModel):
    """Any object."""

    model_config = ConfigDict(extra="allow")


class ForkPlanner(Agent):
    """Delegates to writers; its aggregate quotes their answers in one model call."""

    name = "fork_planner"
    input_model = PlanInput
    output_model = AnyOutput
    delegates_to = ("fork_writer",)

    def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        plan = PlanInput.model_validate(task.payload)
        return Delegate([
            ChildSpec("fork_writer", {"goal": f"{plan.goal}: part {i}",
                                      "fail": plan.fail_part == i, "sleep": plan.sleep},
                      key=f"w{i}")
            for i in range(plan.parts)])

    def aggregate(self, ctx: AgentContext, task: TaskView,
                  children: list[ChildView]) -> Result:
        quoted = json.dumps({c.key: c.result for c in children if c.ok}, sort_keys=True)
        reply = ctx.llm.complete(f"Summarise these drafts: {quoted}", max_tokens=64)
        return Result({"summary": reply.text, "drafts": sum(c.ok for c in children)})


class ForkWriter(Agent):
    """Writes its part with one model call."""

    name = "fork_writer"
    input_model = WriterInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result | Fail:
        part = WriterInput.model_validate(task.payload)
        time.sleep(part.sleep)
        if part.fail:
            return Fail(f"asked to fail: {part.goal}")
        reply = ctx.llm.complete(f"Write a paragraph about {part.goal}", max_tokens=64)
        return Result({"goal": part.goal, "text": reply.text})


def drafts_of(result: dict[str, Any] | None) -> int:
    """How many drafts a planner's result quotes."""
    return int((result or {}).get("drafts", 0))


class StepperInput(BaseModel):
    """What a stepper looks up, and what it posts."""

    model_config = ConfigDict(extra="forbid")
    query: str
    post: str = "done"


#: The side effects the stepper's steps made, in order: ``(step name, argument)``.
STEP_EFFECTS: list[tuple[str, str]] = []


def _lookup(query: str) -> dict[str, str]:
    STEP_EFFECTS.append(("lookup", query))
    return {"query": query, "answer": f"found {query}"}


def _post(text: str) -> str:
    STEP_EFFECTS.append(("post", text))
    return f"posted {text}"


class ForkStepper(Agent):
    """Two durable steps (``ctx.step``): a look-up of its query, then a post."""

    name = "fork_stepper"
    input_model = StepperInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        part = StepperInput.model_validate(task.payload)
        found = ctx.step("lookup", _lookup, part.query)
        posted = ctx.step("post", _post, part.post)
        return Result({"found": found, "posted": posted})
