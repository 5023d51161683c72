"""orgchart: a durable runtime for hierarchical multi-agent systems on PostgreSQL.

The public face for Python (docs/client.md, docs/writing-agents.md,
docs/writing-policies.md):

- for applications, :class:`Client` and :class:`AsyncClient` (over the database, or over
  ``orgchart serve``'s HTTP API with ``Client.http(url, token)``): ``submit`` a goal,
  ``run`` it in this process, ``Run.wait`` for its answer, steer it, answer its
  questions;
- for agent authors, :class:`Agent` and what it returns (:class:`Result`,
  :class:`Delegate` of :class:`ChildSpec`, :class:`Fail`, :class:`Escalate`,
  :class:`RetryChildren`), its context and views, :class:`Tool`, :class:`Completion`;
- for rule authors, :class:`Policy` and :class:`Violation`.

``import orgchart`` imports no model backend and opens no connection: a client opens its
database (or HTTP connection) when it is made.
"""

from __future__ import annotations

from agents.base import (
    Agent,
    AgentError,
    Answer,
    ChildSpec,
    Delegate,
    Escalate,
    Fail,
    GoalInput,
    Question,
    Result,
    RetryChildren,
    TextOutput,
)
from agents.context import AgentContext
from agents.registry import register
from agents.replies import Completion, ToolCall, ToolOutcome
from agents.tasks import ChildView, TaskView
from agents.tools import RetryPolicy, Tool, TransientStepError
from orgchart.aio import AsyncClient, AsyncRun
from orgchart.client import Client, Run
from orgchart.transports import RequestFailed
from policies.base import Policy, Violation
from runtime.errors import BadInput
from runtime.store.rows import IdempotencyConflict, NotFound
from runtime.store.steering import SteeringRefused
from runtime.store.streams import StreamEvent

__all__ = [
    "Agent", "AgentContext", "AgentError", "Answer", "AsyncClient", "AsyncRun", "BadInput",
    "ChildSpec", "ChildView", "Client", "Completion", "Delegate", "Escalate", "Fail",
    "GoalInput", "IdempotencyConflict", "NotFound", "Policy", "Question", "RequestFailed",
    "Result", "RetryChildren", "RetryPolicy", "Run", "SteeringRefused", "StreamEvent", "TaskView",
    "TextOutput", "Tool", "ToolCall", "ToolOutcome", "TransientStepError", "Violation",
    "register",
]
