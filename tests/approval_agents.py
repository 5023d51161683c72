"""The ``clerk`` agent of tests/integration/test_tool_approval.py: a tool needs approval."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from agents.base import Agent, Result, TaskView
from agents.context import AgentContext
from agents.tools import Tool

PAID: list[dict[str, Any]] = []


class PaymentArgs(BaseModel):
    """Who to pay and how much."""

    to: str
    cents: int


def send_payment(to: str, cents: int) -> dict[str, Any]:
    """The side effect a person must approve first."""
    PAID.append({"to": to, "cents": cents})
    return {"paid": True}


class Clerk(Agent):
    """Asks the model, which pays (a tool that requires approval)."""

    name = "clerk"
    tools = (Tool("send_payment", "Send a payment.", PaymentArgs, send_payment,
                  requires_approval=True),)

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        reply = ctx.llm.complete(f"Pay the invoice: {task.input.goal}", tools=ctx.tools)
        return Result({"text": reply.text, "paid": [t.result for t in reply.tool_results]})
