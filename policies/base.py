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

import difflib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

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

    def settings_view(self) -> dict[str, Any]:
        """Return the settings this rule runs with, as ``orgchart policies`` shows them."""
        return {}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class UnknownPolicy(LookupError):
    """No policy rule is registered under that name."""


class DuplicatePolicy(ValueError):
    """Two different classes claim the same rule name."""


class PolicyRegistry:
    """Policy classes by rule name."""

    def __init__(self) -> None:
        self._policies: dict[str, type[Policy]] = {}

    def add(self, cls: type[Policy]) -> type[Policy]:
        """Register ``cls`` under ``cls.name``.

        Raises:
            DuplicatePolicy: another class already has that name (both are named).

        """
        if not cls.name:
            raise ValueError(f"{_qualname(cls)} has no name")
        existing = self._policies.get(cls.name)
        if existing is not None and _qualname(existing) != _qualname(cls):
            raise DuplicatePolicy(
                f"policy name {cls.name!r} is already registered by {_qualname(existing)}; "
                f"{_qualname(cls)} cannot register it too"
            )
        self._policies[cls.name] = cls
        return cls

    def get(self, name: str) -> type[Policy]:
        """Return the class registered as ``name``.

        Raises:
            UnknownPolicy: with the closest registered name suggested.

        """
        try:
            return self._policies[name]
        except KeyError:
            raise UnknownPolicy(unknown_rule_message(name, self._policies)) from None

    def remove(self, name: str) -> None:
        """Forget a rule (tests)."""
        self._policies.pop(name, None)

    def names(self) -> list[str]:
        """Return the registered names, sorted."""
        return sorted(self._policies)

    def __contains__(self, name: object) -> bool:
        return name in self._policies

    def __iter__(self) -> Iterator[type[Policy]]:
        return iter(list(self._policies.values()))


def unknown_rule_message(name: str, known: Any) -> str:
    """``unknown policy rule 'x'; did you mean 'y'?``."""
    names = sorted(known)
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(names)})"
    return f"unknown policy rule {name!r}{hint}"


registry = PolicyRegistry()


def register(cls: type[Policy]) -> type[Policy]:
    """Register a policy class (decorator; subclassing with a ``name`` registers too)."""
    registry.add(cls)
    return cls
