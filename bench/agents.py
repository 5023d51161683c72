"""Agents used only by the benchmarks (``--agents-module bench.agents``).

``stamp`` records the wall-clock time at which its ``run`` starts, so the pickup
benchmark can measure submit-commit -> agent start on one machine's clock.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from agents.base import Agent, Result, TaskView
from agents.context import AgentContext


class StampInput(BaseModel):
    """Any payload."""

    model_config = ConfigDict(extra="allow")
    goal: str = ""


class StampOutput(BaseModel):
    """When the agent started (``time.time()``)."""

    model_config = ConfigDict(extra="allow")
    started: float


class Stamp(Agent):
    """Returns the time its run started."""

    name = "stamp"
    input_model = StampInput
    output_model = StampOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        return Result({"started": time.time()})
