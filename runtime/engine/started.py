"""A claimed task ready for its agent: what it sees, its lazy model handle, what ran.

Pieces of :mod:`runtime.engine.executor` kept apart (the executor's module stays short):

- :class:`Started`: the row, the agent, its view and context, and how to end it;
- :class:`LazyLLM`: ``ctx.llm``, built on first use (a task whose agent makes no model
  call never builds one);
- :func:`stamped`: an action with what ran (the agent's version, the prompts rendered);
- :func:`reads_children` / :func:`raced`: whether the children are read first, and
  whether an aggregate met a child running again.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agents.base import Agent
from agents.context import AgentContext
from agents.tasks import TaskView
from runtime.engine.actions import Action, DelegateAction
from runtime.engine.agent_version import agent_version
from runtime.llm.call_records import held_replays
from runtime.store.rows import TERMINAL_STATUSES, RunOutcome, TaskRow


@dataclass(frozen=True)
class Started:
    """A task ready for its agent: the row, the agent, what it sees, and how to end it."""

    row: TaskRow
    cls: type[Agent]
    agent: Agent
    view: TaskView
    ctx: AgentContext
    llm: Any
    outcome: Callable[..., RunOutcome]


#: The detail of an aggregate that found a child running again (a retry raced fan-in).
RACED = "fan-in raced a retry: waiting again"


def raced(children: list[TaskRow]) -> bool:
    """Whether a child of an aggregating parent is not finished (a retry raced fan-in)."""
    return any(c.status not in TERMINAL_STATUSES for c in children)


def reads_children(started: Started) -> bool:
    """Whether the task's children are read before its agent runs.

    An aggregate is given them. A run reads them only to be judged inline against
    ``max_child_failures`` (a run normally has none yet: a task sent back to ``pending``
    after it delegated has them).
    """
    return (started.view.phase == "aggregate"
            or "max_child_failures" in (started.row.kill_criteria or {}))


def stamped(started: Started, action: Action) -> Action:
    """The action with what ran: version, prompts, replayed calls' rows (``HeldReplays``).

    A model handle never built (the agent made no call) has no replayed rows.
    """
    llm = built_llm(started.llm)
    if isinstance(action, RunOutcome) and action.stamp is None:
        # Built field by field: dataclasses.replace walks the fields on every call (each
        # no-op task of the drain bench goes through here).
        a = action
        return RunOutcome(a.task_id, a.lease_token, a.to_status, a.result, a.error,
                          a.delay_seconds, a.detail, a.verdict, _stamp(started, llm),
                          a.skips_judging)
    if isinstance(action, DelegateAction) and action.stamp is None:
        return dataclasses.replace(action, stamp=_stamp(started, llm))
    held_replays(llm, False)  # written now: a retry of children cannot carry them
    return action


def _stamp(started: Started, llm: Any) -> dict[str, Any]:
    return {"version": agent_version(started.cls), "prompts": dict(started.ctx.prompt_hashes),
            "replays": held_replays(llm, True)}


class LazyLLM:
    """``ctx.llm``, built on first use: a task whose agent makes no model call never builds it.

    Building a task's model handle (its budget, its durable steps, its call records) was
    the largest single cost of a no-op task's run (py-spy, the no-op drain). Every
    attribute read or write goes to the handle, built then by ``make`` (no database, no
    model: building it later changes nothing it would have done).
    """

    __slots__ = ("_llm", "_lock", "_make")

    def __init__(self, make: Callable[[], Any]) -> None:
        object.__setattr__(self, "_make", make)
        object.__setattr__(self, "_llm", None)
        object.__setattr__(self, "_lock", threading.Lock())

    @property
    def built(self) -> Any:
        """The handle if it was built, else None."""
        return self._llm

    def _get(self) -> Any:
        llm = self._llm
        if llm is None:
            with self._lock:  # an agent's threads share one handle (one budget)
                llm = self._llm
                if llm is None:
                    llm = self._make()
                    object.__setattr__(self, "_llm", llm)
        return llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._get(), name, value)


def built_llm(llm: Any) -> Any:
    """The model handle behind ``llm`` if one was built (None for a lazy one never used)."""
    return llm.built if isinstance(llm, LazyLLM) else llm


def check_tools_with(llm: Any, policies: Any, view: TaskView) -> None:
    """Let the tool loop ask the policies (``allowed_tools``) before each tool call runs."""
    validate_tool = getattr(policies, "validate_tool", None)
    if validate_tool is None or not hasattr(llm, "tool_check"):
        return

    def check(tool: str) -> str | None:
        violation = validate_tool(view, tool)
        return None if violation is None else str(violation)

    llm.tool_check = check
