"""The context an agent runs with: the model, prompts, budget, steps and a logger; no database."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from string import Template
from typing import Any, Protocol, TypeVar, overload

from pydantic import BaseModel

from agents.replies import Completion
from agents.tasks import TaskView
from agents.tools import RetryPolicy, Tool

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"
#: The pydantic class a structured call's output is an instance of.
M = TypeVar("M", bound=BaseModel)


class PromptNotFound(LookupError):
    """No prompt file with that name."""


class LLM(Protocol):
    """What ``ctx.llm`` offers (implemented by ``runtime.llm.handle.TaskLLM``).

    The reply's type follows ``schema=``: a pydantic class ``Plan`` gives a
    ``Completion[Plan]`` (``reply.output`` is a ``Plan``), no schema a
    ``Completion[str]`` (the text), a JSON schema dict a ``Completion[Any]``.
    """

    @overload
    def complete(self, prompt: str, *, schema: type[M], system: str | None = None,
                 max_tokens: int | None = None, key: str | None = None,
                 tools: Sequence[Tool] | None = None,
                 max_tool_rounds: int | None = None) -> Completion[M]: ...

    @overload
    def complete(self, prompt: str, *, schema: dict[str, Any], system: str | None = None,
                 max_tokens: int | None = None, key: str | None = None,
                 tools: Sequence[Tool] | None = None,
                 max_tool_rounds: int | None = None) -> Completion[Any]: ...

    @overload
    def complete(self, prompt: str, *, schema: None = None, system: str | None = None,
                 max_tokens: int | None = None, key: str | None = None,
                 tools: Sequence[Tool] | None = None,
                 max_tool_rounds: int | None = None) -> Completion[str]: ...

    def complete(self, prompt: str, *, schema: type[BaseModel] | dict[str, Any] | None = None,
                 system: str | None = None, max_tokens: int | None = None,
                 key: str | None = None, tools: Sequence[Tool] | None = None,
                 max_tool_rounds: int | None = None) -> Completion[Any]:
        """Call the model; see ``runtime.llm.handle.TaskLLM.acomplete``."""
        ...

    @overload
    async def acomplete(self, prompt: str, *, schema: type[M], system: str | None = None,
                        max_tokens: int | None = None, key: str | None = None,
                        tools: Sequence[Tool] | None = None,
                        max_tool_rounds: int | None = None) -> Completion[M]: ...

    @overload
    async def acomplete(self, prompt: str, *, schema: dict[str, Any],
                        system: str | None = None, max_tokens: int | None = None,
                        key: str | None = None, tools: Sequence[Tool] | None = None,
                        max_tool_rounds: int | None = None) -> Completion[Any]: ...

    @overload
    async def acomplete(self, prompt: str, *, schema: None = None, system: str | None = None,
                        max_tokens: int | None = None, key: str | None = None,
                        tools: Sequence[Tool] | None = None,
                        max_tool_rounds: int | None = None) -> Completion[str]: ...

    async def acomplete(self, prompt: str, *,
                        schema: type[BaseModel] | dict[str, Any] | None = None,
                        system: str | None = None, max_tokens: int | None = None,
                        key: str | None = None, tools: Sequence[Tool] | None = None,
                        max_tool_rounds: int | None = None) -> Completion[Any]:
        """Call the model from an ``async`` agent; several may run at once (``gather``)."""
        ...


class Steps(Protocol):
    """What ``ctx.step`` runs on (implemented by ``runtime.llm.durable_steps.TaskSteps``)."""

    def step(self, name: str, fn: Any, *args: Any, retry: RetryPolicy | None = None,
             **kwargs: Any) -> Any:
        """Run ``fn`` once for the task, recorded (``runtime.llm.durable_steps.TaskSteps``)."""
        ...

    async def astep(self, name: str, fn: Any, *args: Any, retry: RetryPolicy | None = None,
                    **kwargs: Any) -> Any:
        """The same from a coroutine."""
        ...


def load_prompt(name: str, prompts_dir: Path = PROMPTS_DIR) -> Template:
    """Return the prompt ``prompts/<name>.md`` as a ``string.Template`` (``$var``)."""
    path = prompts_dir / f"{name}.md"
    if not path.is_file():
        known = sorted(p.stem for p in prompts_dir.glob("*.md"))
        raise PromptNotFound(f"no prompt {name!r} in {prompts_dir} (have: {', '.join(known)})")
    return Template(path.read_text(encoding="utf-8"))


def prompt_hash(text: str) -> str:
    """A short hash of a prompt's text (what a re-run compares)."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def render_prompt(name: str, prompts_dir: Path = PROMPTS_DIR, **variables: Any) -> str:
    """Render a prompt; a missing variable is an error naming it."""
    template = load_prompt(name, prompts_dir)
    try:
        return template.substitute({k: str(v) for k, v in variables.items()})
    except KeyError as exc:
        raise KeyError(f"prompt {name!r} needs variable {exc.args[0]!r}") from None


@dataclass
class AgentContext:
    """Everything an agent may use while it works on one task.

    Attributes:
        llm: budget-aware model calls bound to this task (``ctx.llm.complete(...)``).
        task: the task being worked on.
        log: a logger named after the agent.
        lease_lost: set by the worker's heartbeat when the task was taken away.
        steps: the task's durable steps (default: the model handle's, ``llm.steps``).
        tools: the agent's tools and the MCP tools configured for it: hand them to the
            model with ``ctx.llm.complete(prompt, tools=ctx.tools)``.

    """

    llm: LLM
    task: TaskView
    log: logging.Logger
    prompts_dir: Path = PROMPTS_DIR
    lease_lost: threading.Event = field(default_factory=threading.Event)
    offline: bool = False
    steps: Steps | None = None
    tools: tuple[Tool, ...] = ()

    def step(self, name: str, fn: Any, *args: Any, retry: RetryPolicy | None = None,
             **kwargs: Any) -> Any:
        """Run a side effect ``fn(*args, **kwargs)`` once for this task, as a durable step.

        Its JSON-serialisable result is recorded; when the task is delivered again (its
        worker died, a transient retry), the same step at the same place returns the
        recorded result without running. ``fn`` may read its stable idempotency key with
        ``agents.tools.idempotency_key()`` (or take an ``idempotency_key`` keyword);
        ``retry=RetryPolicy(...)`` retries transient errors with backoff.
        """
        return self._steps().step(name, fn, *args, retry=retry, **kwargs)

    async def astep(self, name: str, fn: Any, *args: Any, retry: RetryPolicy | None = None,
                    **kwargs: Any) -> Any:
        """:meth:`step` from an ``async`` agent; ``fn`` may be ``async def`` (awaited here)."""
        return await self._steps().astep(name, fn, *args, retry=retry, **kwargs)

    def _steps(self) -> Steps:
        steps = self.steps if self.steps is not None else getattr(self.llm, "steps", None)
        if steps is None:
            raise RuntimeError("this context has no durable steps (give AgentContext steps=)")
        return steps

    #: The prompts rendered so far: name -> a short hash of the file (recorded with the task).
    prompt_hashes: dict[str, str] = field(default_factory=dict)

    def prompt(self, name: str, **variables: Any) -> str:
        """Render ``prompts/<name>.md`` with ``$variables`` (its hash is recorded)."""
        text = render_prompt(name, self.prompts_dir, **variables)
        self.prompt_hashes[name] = prompt_hash(load_prompt(name, self.prompts_dir).template)
        return text

    @property
    def remaining_tokens(self) -> int:
        """Tokens this task's subtree may still spend (budget minus spend so far)."""
        if hasattr(self.llm, "remaining_tokens"):
            return int(self.llm.remaining_tokens())
        return max(0, self.task.budget_tokens - self.task.spent_tokens)

    @property
    def remaining_usd(self) -> Decimal:
        """USD this task's subtree may still spend."""
        if hasattr(self.llm, "remaining_usd"):
            return Decimal(self.llm.remaining_usd())
        return max(Decimal(0), self.task.budget_usd - self.task.spent_usd)
