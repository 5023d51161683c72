"""What a policy is: a registered class that can veto a task's input, output or delegation.

A policy answers ``None`` (fine) or a :class:`Violation` (rule name, message). The worker
moves a task whose input, output or delegation breaks a rule to ``escalated`` with
``str(violation)`` (``"policy max_depth: ..."``) in ``error``. Subclassing
:class:`Policy` with a ``name`` registers the rule, as subclassing ``Agent`` registers an
agent; :func:`policies.loader.load_policy_set` decides which registered rules are active.

Example::

    class NoShouting(Policy):
        name = "no_shouting"
        description = "Refuse results written in capitals."

        def validate_output(self, task, result):
            text = json.dumps(result)
            if text.isupper():
                return Violation(self.name, "the result is shouting")
            return None
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from runtime.registry import Registry as NamedRegistry
from runtime.registry import unknown_message

if TYPE_CHECKING:
    from agents.base import ChildSpec, TaskView
    from agents.registry import Registry
    from runtime.config import Settings


@dataclass(frozen=True)
class Violation:
    """A broken rule: which one, and why (never echoing a secret it found)."""

    rule: str
    message: str

    def __str__(self) -> str:
        return f"policy {self.rule}: {self.message}"


class Policy:
    """Base class of every policy rule. Subclasses with a ``name`` are registered.

    Class attributes:
        name: unique rule name (``Violation.rule``; what ``[policies] disabled`` lists).
        description: one line shown by ``orgchart policies``.
        register: set False on an abstract intermediate class.

    Instance attributes:
        settings: the whole validated configuration.
        agents: the agent registry (set by the loader; None when built by hand), so a
            rule can look at agent classes (their schemas, their ``delegates_to``).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    register: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("register", True) and cls.__dict__.get("name"):
            registry.add(cls)

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.agents: Registry | None = None

    @classmethod
    def inactive_reason(cls, settings: Settings) -> str | None:
        """Why this rule is switched off by its own settings, or None when it is on."""
        return None

    def violation(self, message: str) -> Violation:
        """Return a violation of this rule with ``message``."""
        return Violation(self.name, message)

    def validate_input(self, task: TaskView) -> Violation | None:
        """Check a task before its agent runs."""
        return None

    def validate_output(self, task: TaskView, result: Any) -> Violation | None:
        """Check an agent's result (plain JSON values) before the judge sees it."""
        return None

    def validate_delegation(self, parent: TaskView, children: list[ChildSpec]) -> Violation | None:
        """Check the children a task wants to create before any is written."""
        return None

    def validate_tool(self, task: TaskView, tool: str) -> Violation | None:
        """Check a tool call the model asked for, before the tool runs (never run if refused)."""
        return None

    def settings_view(self) -> dict[str, Any]:
        """Return the settings this rule runs with, as ``orgchart policies`` shows them."""
        return {}


class UnknownPolicy(LookupError):
    """No policy rule is registered under that name."""


class DuplicatePolicy(ValueError):
    """Two different classes claim the same rule name."""


def unknown_rule_message(name: str, known: Iterable[str]) -> str:
    """``unknown policy rule 'x'; did you mean 'y'?``."""
    return unknown_message("policy rule", name, known)


#: Every policy class defined so far, by rule name (the generic registry agents use too).
registry: NamedRegistry[type[Policy]] = NamedRegistry("policy rule", UnknownPolicy,
                                                      DuplicatePolicy)


def register(cls: type[Policy]) -> type[Policy]:
    """Register a policy class (decorator; subclassing with a ``name`` registers too)."""
    registry.add(cls)
    return cls
