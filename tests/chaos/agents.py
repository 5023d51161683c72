"""Agents for the chaos suite: every task spends model tokens, so spend roll-ups are checked.

The leaves (``spender``) are ``async def``: a worker holds hundreds of them at once.

Loaded with ``--agents-module tests.chaos.agents`` (the repository root on the path); it
also registers ``tests.support_agents`` (echo, fanout, ...). With the offline backend a
model call is deterministic, needs no network, and is still charged and recorded like a
real one: that is what lets the suite check that a tree's totals equal the sum of its
nodes after workers died in the middle of charging.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from pydantic import BaseModel, Field

from agents.base import Agent, ChildSpec, Delegate, Escalate, Result, TaskView
from agents.context import AgentContext
from agents.tools import Tool
from tests.support_agents import AnyInput, AnyOutput

#: Completion tokens asked per call: small, so even a grandchild's carved budget covers it.
CALL_MAX_TOKENS = 24


def _spend(ctx: AgentContext, task: TaskView, what: str) -> int:
    reply = ctx.llm.complete(f"chaos {what}: {task.payload.get('goal', '')}",
                             max_tokens=CALL_MAX_TOKENS)
    return int(reply.prompt_tokens + reply.completion_tokens)


async def _aspend(ctx: AgentContext, task: TaskView, what: str) -> int:
    """``_spend`` from a coroutine: ``await ctx.llm.acomplete``."""
    reply = await ctx.llm.acomplete(f"chaos {what}: {task.payload.get('goal', '')}",
                                    max_tokens=CALL_MAX_TOKENS)
    return int(reply.prompt_tokens + reply.completion_tokens)


#: Where each leaf (``spender``) appends ``<task id> <time.time()>`` when it wakes from
#: its nap, right before its model call (set by the test): the sign a test waits on.
WOKE_ENV = "CHAOS_WOKE_LOG"


class Spender(Agent):
    """A leaf that naps ``sleep`` seconds, then makes one (offline) model call.

    ``async def``: a worker holds every leaf it can claim (up to ``max_in_flight``) at
    once, so the kills and the server faults hit hundreds of tasks in flight. Awake, it
    says so in the file :data:`WOKE_ENV` names, if any.
    """

    name = "spender"
    input_model = AnyInput
    output_model = AnyOutput

    async def run(self, ctx: AgentContext, task: TaskView) -> Result:
        await asyncio.sleep(float(task.payload.get("sleep", 0)))
        path = os.environ.get(WOKE_ENV)
        if path:
            with open(path, "a", encoding="utf-8") as log:
                log.write(f"{task.id} {time.time()}\n")
        return Result({"tokens": await _aspend(ctx, task, "leaf")})


class SpendingFanout(Agent):
    """Spends once, delegates ``n`` children, spends again when it aggregates.

    Payload: ``n`` children (default 4); ``inner`` > 0 makes the children fan-outs of
    ``inner`` spenders each (a three-level tree); ``sleep`` is passed to the leaves.
    """

    name = "spend_fanout"
    input_model = AnyInput
    output_model = AnyOutput
    delegates_to = ("spender", "spend_fanout")

    def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        _spend(ctx, task, "plan")
        n = int(task.payload.get("n", 4))
        inner = int(task.payload.get("inner", 0))
        sleep = task.payload.get("sleep", 0)
        if inner > 0:
            return Delegate([ChildSpec("spend_fanout", {"goal": f"branch {i}", "n": inner,
                                                        "sleep": sleep}, key=f"branch-{i}")
                             for i in range(n)])
        return Delegate([ChildSpec("spender", {"goal": f"part {i}", "sleep": sleep},
                                   key=f"part-{i}") for i in range(n)])

    def aggregate(self, ctx: AgentContext, task: TaskView, children: list[Any]) -> Any:
        failed = [c for c in children if not c.ok]
        if failed:
            return Escalate(f"{len(failed)} of {len(children)} children did not end done")
        return Result({"parts": len(children), "tokens": _spend(ctx, task, "aggregate")})


class TenCalls(Agent):
    """Drafts, critiques and revises in ten sequential model calls (durable-call chaos).

    Each prompt is built from the task's payload and the previous reply only, as the
    durable-call contract asks, so a re-delivered task asks the same things in the same
    order and is served the recorded replies.
    """

    name = "ten_calls"
    input_model = AnyInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        previous = str(task.payload.get("goal", ""))
        replayed = 0
        for step in range(10):
            reply = ctx.llm.complete(f"step {step} of 10; revise: {previous[:80]}",
                                     max_tokens=CALL_MAX_TOKENS)
            replayed += int(bool(getattr(reply, "replayed", False)))
            previous = reply.text
        return Result({"last": previous, "replayed_in_this_delivery": replayed})


#: How long one tool call of ``six_tools`` works (the steps-under-crash chaos test).
TOOL_SECONDS = 0.5
#: Where each tool call that ran appends its idempotency key (set by the test).
SIDE_EFFECTS_ENV = "CHAOS_SIDE_EFFECTS_LOG"


class WorkArgs(BaseModel):
    """One unit of work."""

    n: int = Field(ge=0, le=100)


async def work(n: int, idempotency_key: str) -> dict[str, Any]:
    """A tool with a visible side effect: sleep, then append one line keyed by the call."""
    await asyncio.sleep(TOOL_SECONDS)
    path = os.environ.get(SIDE_EFFECTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{idempotency_key}\n")
    return {"n": n, "done": True}


class SixTools(Agent):
    """Asks the model, which calls the ``work`` tool six times, one call per round."""

    name = "six_tools"
    input_model = AnyInput
    output_model = AnyOutput
    tools = (Tool("work", "Do unit of work number n.", WorkArgs, work),)

    async def run(self, ctx: AgentContext, task: TaskView) -> Result:
        reply = await ctx.llm.acomplete(f"do six units of work for {task.payload.get('goal')}",
                                        tools=ctx.tools, max_tool_rounds=10,
                                        max_tokens=CALL_MAX_TOKENS)
        return Result({"tool_calls": len(reply.tool_results), "rounds": reply.tool_rounds,
                       "replayed": sum(t.replayed for t in reply.tool_results)})
