"""The built-in agent ``human``: a person, asked a question by any agent.

An agent delegates to it like to any agent::

    Delegate([ChildSpec(agent="human", key="go-ahead", budget_seconds=3600,
                        payload={"question": "Publish the report?",
                                 "choices": ["yes", "no"]})])

No worker ever claims a ``human`` task: it waits, as a child does, until a person
answers it (``orgchart answer TASK_ID --json ...``, ``POST /tasks/{id}/answer`` or the
form on the tree page). The answer is checked against ``answer_schema`` (a JSON Schema)
and ``choices`` (the answer is one of them, or ``{"choice": one of them}``) and becomes
the task's result; the task ends ``done`` and the asking parent aggregates as usual. Its
``budget_seconds`` is the question's deadline: past it, the task fails with
``error = 'no answer: deadline'`` and the parent decides, as for any failed child.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from agents.base import Agent, AgentError, RunOutput, TaskView

if TYPE_CHECKING:
    from agents.context import AgentContext

#: The agent's name (the ``to_agent`` of every question); the store knows it too.
HUMAN = "human"


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
