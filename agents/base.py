"""What an agent is: a registered class with schemas, ``run`` and ``aggregate``.

An agent never touches the database and never calls another agent. ``run(ctx, task)``
returns a :class:`Result` (the answer, which then passes policies and the judge), a
:class:`Delegate` (child specs: the runtime inserts the children and parks the task in
``waiting`` until all of them finish), or :class:`Fail` / :class:`Escalate`.
``aggregate(ctx, task, children)`` turns the finished children into the task's result,
or sends some of them back with :class:`RetryChildren` (optionally to another agent).

Example::

    class Summarizer(Agent):
        name = "summarizer"
        types = ("summary",)
        input_model = SummaryIn
        output_model = SummaryOut

        def run(self, ctx, task):
            reply = ctx.llm.complete(ctx.prompt("summarizer", text=task.input.text),
                                     schema=SummaryOut)  # a Completion[SummaryOut]
            return Result(reply.output)
"""

from __future__ import annotations

import builtins
import inspect
import linecache
import logging
import sys
import uuid
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from agents.tasks import (
    DEFAULT_BUDGET_SECONDS,
    DEFAULT_BUDGET_TOKENS,
    DEFAULT_BUDGET_USD,
    ChildView,
    TaskView,
)
from agents.tools import Tool
from runtime.constants import HUMAN_AGENT

if TYPE_CHECKING:
    from agents.context import AgentContext

__all__ = [
    "DEFAULT_BUDGET_SECONDS",
    "DEFAULT_BUDGET_TOKENS",
    "DEFAULT_BUDGET_USD",
    "Agent",
    "AgentError",
    "AggregateOutput",
    "ChildSpec",
    "ChildView",
    "Delegate",
    "Escalate",
    "Fail",
    "GoalInput",
    "Result",
    "RetryChildren",
    "RunOutput",
    "TaskView",
    "TextOutput",
    "agent_logger",
]


class GoalInput(BaseModel):
    """The default input: a free-text goal plus optional context."""

    model_config = ConfigDict(extra="allow")

    goal: str
    context: dict[str, Any] | None = None


class TextOutput(BaseModel):
    """The default output: a text answer."""

    model_config = ConfigDict(extra="allow")

    text: str


@dataclass(frozen=True, init=False)
class ChildSpec:
    """One child to delegate to: ``ChildSpec(agent=HaikuPoet, payload=..., key=...)``.

    ``agent`` is the agent's class or its registered name (kept as the name).
    ``key`` makes the child unique under its parent: a parent that runs again (after a
    crash or a retry) never creates the same child twice. Budgets left as None are
    carved evenly from what the parent has left.
    """

    agent: str
    payload: dict[str, Any]
    key: str
    type: str = "task"
    priority: int | None = None
    budget_tokens: int | None = None
    budget_seconds: int | None = None
    budget_usd: Decimal | None = None
    success_criteria: dict[str, Any] | None = None
    kill_criteria: dict[str, Any] | None = None

    def __init__(self, agent: str | builtins.type[Agent], payload: dict[str, Any], key: str,
                 type: str = "task", priority: int | None = None,
                 budget_tokens: int | None = None, budget_seconds: int | None = None,
                 budget_usd: Decimal | None = None,
                 success_criteria: dict[str, Any] | None = None,
                 kill_criteria: dict[str, Any] | None = None) -> None:
        fields = {"agent": agent.name if isinstance(agent, builtins.type) else agent,
                  "payload": payload, "key": key, "type": type, "priority": priority,
                  "budget_tokens": budget_tokens, "budget_seconds": budget_seconds,
                  "budget_usd": budget_usd, "success_criteria": success_criteria,
                  "kill_criteria": kill_criteria}
        for name, value in fields.items():  # frozen: set once, as a dataclass's own init
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class Result:
    """The task's answer; validated against the agent's ``output_model``."""

    output: Any


@dataclass(frozen=True)
class Delegate:
    """Fan out to children; the task waits until all of them are terminal."""

    children: list[ChildSpec]
    note: str | None = None


@dataclass(frozen=True)
class Fail:
    """The agent gives up: the task ends ``failed`` (not retried automatically)."""

    reason: str


@dataclass(frozen=True)
class Escalate:
    """The agent asks a person (or a higher agent) to decide: the task ends ``escalated``."""

    reason: str


@dataclass(frozen=True)
class RetryChildren:
    """From ``aggregate``: send failed or escalated children back, optionally reassigned."""

    child_ids: list[uuid.UUID]
    reassign_to: str | None = None
    note: str | None = None


RunOutput = Result | Delegate | Fail | Escalate
AggregateOutput = Result | Fail | Escalate | RetryChildren


class AgentError(Exception):
    """An agent-level failure: the task ends ``failed`` with this message."""


def module_lines(cls: type) -> list[str]:
    """The lines of the file that defines ``cls``, as loaded (``inspect.findsource``'s read).

    Taken when an agent class is defined, so its default version
    (``runtime/engine/agent_version.py``) hashes the code that was loaded even if the file
    is edited before the version is first read (``linecache``: one read per module).
    """
    try:
        file = inspect.getsourcefile(cls) or inspect.getfile(cls)
    except (OSError, TypeError):  # a built-in class, or one defined without a file
        return []
    module = sys.modules.get(cls.__module__)
    return linecache.getlines(file, module.__dict__ if module is not None else None)


class Agent:
    """Base class of every agent. Subclasses are registered by name when defined.

    Class attributes:
        name: unique agent name (the ``to_agent`` of its tasks).
        types: task types it handles (the first is the default for new tasks).
        input_model / output_model: pydantic models; their JSON schemas are the contract.
        delegates_to: agents it may delegate to (the org chart's edges).
        prompt_name: prompt file in ``prompts/`` (defaults to ``name``).
        prompts_dir: where ``ctx.prompt`` looks (default: the package's ``prompts/``);
            user agents point it at their own folder.
        tools: tools its model calls may use (``agents.tools.Tool``); ``ctx.tools`` holds
            them, with the MCP tools configured for the agent (``[mcp.servers.*] agents``).
        register: set False on an abstract intermediate class.
        version: what a re-run compares (``orgchart diff``); recorded on every task the
            agent runs. Unset (``""``): the runtime records a short hash of the class's
            source (``runtime/engine/agent_version.py``), so editing the class changes
            it; set it to name versions yourself.
        loaded_lines: the lines of the class's module as loaded (:func:`module_lines`),
            which the runtime hashes the class's source from; set for every subclass.
    """

    name: ClassVar[str] = ""
    types: ClassVar[tuple[str, ...]] = ("task",)
    description: ClassVar[str] = ""
    input_model: ClassVar[type[BaseModel]] = GoalInput
    output_model: ClassVar[type[BaseModel]] = TextOutput
    delegates_to: ClassVar[tuple[str, ...]] = ()
    prompt_name: ClassVar[str | None] = None
    prompts_dir: ClassVar[Path | None] = None
    tools: ClassVar[tuple[Tool, ...]] = ()
    register: ClassVar[bool] = True
    version: ClassVar[str] = ""
    loaded_lines: ClassVar[list[str]] = []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.loaded_lines = module_lines(cls)
        if cls.__dict__.get("register", True) and cls.__dict__.get("name"):
            from agents.registry import registry

            registry.add(cls)

    def run(self, ctx: AgentContext, task: TaskView) -> RunOutput:
        """Do the task: return a Result, a Delegate, a Fail or an Escalate."""
        raise NotImplementedError(f"agent {self.name!r} does not implement run()")

    def aggregate(self, ctx: AgentContext, task: TaskView,
                  children: list[ChildView]) -> AggregateOutput:
        """Turn finished children into this task's result.

        The default escalates when any child did not end ``done`` and otherwise
        collects the children's results by key.
        """
        bad = [c for c in children if not c.ok]
        if bad:
            detail = "; ".join(f"{c.agent} {c.status}: {c.error or 'no error'}" for c in bad)
            return Escalate(f"{len(bad)} of {len(children)} children did not succeed: {detail}")
        return Result({"children": {c.key or str(c.id): c.result for c in children}})


def agent_logger(name: str) -> logging.Logger:
    """The logger agents write to: ``orgchart.agents.<name>``."""
    return logging.getLogger(f"orgchart.agents.{name}")


# ---------------------------------------------------------------------- a person
# The built-in agent ``human``: a person, asked a question by any agent. It lives here,
# beside ``Agent``, because it is part of the contract every agent is written against.
#
# An agent delegates to it like to any agent::
#
#     Delegate([ChildSpec(agent="human", key="go-ahead", budget_seconds=3600,
#                         payload={"question": "Publish the report?",
#                                  "choices": ["yes", "no"]})])
#
# No worker ever claims a ``human`` task: it waits, as a child does, until a person
# answers it (``orgchart answer TASK_ID --json ...``, ``POST /tasks/{id}/answer`` or the
# form on the tree page). The answer is checked against ``answer_schema`` (a JSON Schema)
# and ``choices`` (the answer is one of them, or ``{"choice": one of them}``) and becomes
# the task's result; the task ends ``done`` and the asking parent aggregates as usual. Its
# ``budget_seconds`` is the question's deadline: past it, the task fails with
# ``error = 'no answer: deadline'`` and the parent decides, as for any failed child.

#: The agent's name (the ``to_agent`` of every question), as the store knows it.
HUMAN = HUMAN_AGENT


class Question(BaseModel):
    """A question to a person."""

    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1, description="What to ask, in plain words.")
    answer_schema: dict[str, Any] | None = Field(
        None, description="A JSON Schema the answer must match.")
    choices: list[Any] | None = Field(
        None, description="The answers allowed (the answer is one of them).")


class Answer(BaseModel):
    """Whatever the person answered (checked against the question's schema and choices)."""

    model_config = ConfigDict(extra="allow")


class Human(Agent):
    """A person: answers questions other agents ask (never run by a worker)."""

    name = HUMAN
    description = "A person: answers questions (orgchart inbox / answer); never run by a worker."
    input_model = Question
    output_model = Answer

    def run(self, ctx: AgentContext, task: TaskView) -> RunOutput:
        """Never called: a person answers, no worker claims a question."""
        raise AgentError("a question to 'human' is answered by a person (orgchart answer), "
                         "not run by a worker")
