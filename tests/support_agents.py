"""Small agents that drive the lifecycle in tests, chaos runs and benchmarks.

Loaded with ``--agents-module tests.support_agents`` (the repository root on the path).
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
from pydantic import BaseModel, ConfigDict

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
from runtime.errors import TransientModelError


class AnyInput(BaseModel):
    """Accepts any payload with a goal."""

    model_config = ConfigDict(extra="allow")
    goal: str = ""


class AnyOutput(BaseModel):
    """Any object."""

    model_config = ConfigDict(extra="allow")


class Noop(Agent):
    """Returns at once (benchmarks)."""

    name = "noop"
    input_model = AnyInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        return Result({"ok": True})


class AsyncNoop(Agent):
    """Returns at once, from an ``async def run`` (benchmarks: like pgqueuer's no-op job)."""

    name = "async_noop"
    input_model = AnyInput
    output_model = AnyOutput

    async def run(self, ctx: AgentContext, task: TaskView) -> Result:
        return Result({"ok": True})


class HalfAsync(Agent):
    """A plain ``run`` and an ``async def aggregate`` (which method a phase needs)."""

    name = "half_async"
    input_model = AnyInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        return Result({"ok": True})

    async def aggregate(self, ctx: AgentContext, task: TaskView,
                        children: list[ChildView]) -> Result:
        return Result({"children": len(children)})


class Echo(Agent):
    """Echoes its payload; sleeps ``sleep`` seconds first when asked."""

    name = "echo"
    input_model = AnyInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        time.sleep(float(task.payload.get("sleep", 0)))
        return Result({"echo": task.payload.get("goal"), "pid": os.getpid()})


class Fanout(Agent):
    """Delegates to ``n`` echo children (each may sleep), then sums them.

    Failed children: retried (``retry_failed``, reassigned to ``reassign``), else the
    parent escalates, unless ``tolerate`` (then its result counts them).
    """

    name = "fanout"
    input_model = AnyInput
    output_model = AnyOutput
    delegates_to = ("echo", "fanout", "flaky", "boom")

    def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        n = int(task.payload.get("n", 3))
        child = str(task.payload.get("child", "echo"))
        sleep = task.payload.get("sleep", 0)
        return Delegate([ChildSpec(child, {"goal": f"part {i}", "sleep": sleep}, key=f"part-{i}")
                         for i in range(n)])

    def aggregate(self, ctx: AgentContext, task: TaskView, children: list[Any]) -> Any:
        failed = [c for c in children if not c.ok]
        if failed and task.payload.get("retry_failed") and all(
                c.status == "failed" for c in failed) and task.attempt < 3:
            return RetryChildren([c.id for c in failed],
                                 reassign_to=str(task.payload.get("reassign", "echo")))
        if failed and task.payload.get("tolerate"):
            return Result({"parts": len(children), "failed": len(failed)})
        if failed:
            return Escalate(f"{len(failed)} children failed")
        return Result({"parts": len(children)})


class Flaky(Agent):
    """Raises a transient model error (the backend is 'unreachable')."""

    name = "flaky"
    input_model = AnyInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        raise TransientModelError("connection refused (test)")


class DatabaseGone(Agent):
    """Opens a connection the server refuses: psycopg's own error, as the step writer sees."""

    name = "dbgone"
    input_model = AnyInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        psycopg.connect("postgresql://postgres@127.0.0.1:1/none", connect_timeout=2).close()
        return Result({})


class Boom(Agent):
    """Raises an ordinary exception: an agent failure, not retried."""

    name = "boom"
    input_model = AnyInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        raise RuntimeError("kaboom")


class Nul(Agent):
    """Returns a result PostgreSQL's jsonb refuses (a NUL character)."""

    name = "nul"
    input_model = AnyInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        return Result({"text": "bad \u0000 byte"})
