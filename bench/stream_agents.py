"""The agent of ``bench.streaming``'s resume measure (``--agents-module bench.stream_agents``).

``long_writer`` makes one free-text model call of up to ``max_tokens`` tokens (payload,
default 400): long enough on the embedded model for a worker to be SIGKILLed while it
generates.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from agents.base import Agent, Result, TaskView
from agents.context import AgentContext


class LongInput(BaseModel):
    """What to write about, and how long the reply may be."""

    model_config = ConfigDict(extra="allow")
    goal: str = ""
    max_tokens: int = 400


class LongOutput(BaseModel):
    """The reply's length."""

    model_config = ConfigDict(extra="allow")
    chars: int


class LongWriter(Agent):
    """One long free-text call (the embedded model streams it token by token)."""

    name = "long_writer"
    input_model = LongInput
    output_model = LongOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        """Write at length about the goal."""
        reply = ctx.llm.complete(
            f"Write a long, detailed essay about {task.payload.get('goal', '')}.",
            max_tokens=int(task.payload.get("max_tokens", 400)))
        return Result({"chars": len(reply.text)})
