"""The context an agent runs with: the model, prompts, budget and a logger; no database."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from string import Template
from typing import Any, Protocol

from agents.tasks import TaskView

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"


class PromptNotFound(LookupError):
    """No prompt file with that name."""


class LLM(Protocol):
    """What ``ctx.llm`` offers (implemented by ``runtime.llm.handle.TaskLLM``)."""

    def complete(self, prompt: str, *, schema: Any = None, system: str | None = None,
                 max_tokens: int | None = None, key: str | None = None) -> Any:
        """Call the model; see ``runtime.llm.handle.TaskLLM.complete``."""
        ...

    async def acomplete(self, prompt: str, *, schema: Any = None, system: str | None = None,
                        max_tokens: int | None = None, key: str | None = None) -> Any:
        """Call the model from an ``async`` agent; several may run at once (``gather``)."""
        ...


def load_prompt(name: str, prompts_dir: Path = PROMPTS_DIR) -> Template:
    """Return the prompt ``prompts/<name>.md`` as a ``string.Template`` (``$var``)."""
    path = prompts_dir / f"{name}.md"
    if not path.is_file():
        known = sorted(p.stem for p in prompts_dir.glob("*.md"))
        raise PromptNotFound(f"no prompt {name!r} in {prompts_dir} (have: {', '.join(known)})")
    return Template(path.read_text(encoding="utf-8"))


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

    """

    llm: LLM
    task: TaskView
    log: logging.Logger
    prompts_dir: Path = PROMPTS_DIR
    lease_lost: threading.Event = field(default_factory=threading.Event)
    offline: bool = False

    def prompt(self, name: str, **variables: Any) -> str:
        """Render ``prompts/<name>.md`` with ``$variables``."""
        return render_prompt(name, self.prompts_dir, **variables)

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
