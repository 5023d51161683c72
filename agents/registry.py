"""The agent registry: ``dict[str, type[Agent]]``, filled by subclassing or ``@register``.

A duplicate name raises with both classes named; an unknown name suggests the closest
registered one. User agents come from importable modules (``--agents-module``,
``[agents] modules``); the seed's org is built in.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

if TYPE_CHECKING:
    from agents.base import Agent

A = TypeVar("A", bound="type[Agent]")

BUILTIN_MODULES = ("agents.ceo", "agents.intel_director", "agents.scouts", "agents.judge")


class UnknownAgent(LookupError):
    """No agent is registered under that name."""


class DuplicateAgent(ValueError):
    """Two different classes claim the same agent name."""


class InvalidInput(ValueError):
    """A payload that does not match the agent's input schema."""


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class Registry:
    """Agent classes by name."""

    def __init__(self) -> None:
        self._agents: dict[str, type[Agent]] = {}

    def add(self, cls: type[Agent]) -> type[Agent]:
        """Register ``cls`` under ``cls.name``.

        Raises:
            DuplicateAgent: another class already has that name.

        """
        if not cls.name:
            raise ValueError(f"{_qualname(cls)} has no name")
        existing = self._agents.get(cls.name)
        if existing is not None and _qualname(existing) != _qualname(cls):
            raise DuplicateAgent(
                f"agent name {cls.name!r} is already registered by {_qualname(existing)}; "
                f"{_qualname(cls)} cannot register it too"
            )
        self._agents[cls.name] = cls
        return cls

    def get(self, name: str) -> type[Agent]:
        """Return the class registered as ``name``.

        Raises:
            UnknownAgent: with the closest registered name suggested.

        """
        try:
            return self._agents[name]
        except KeyError:
            raise UnknownAgent(unknown_message(name, list(self._agents))) from None

    def __contains__(self, name: object) -> bool:
        return name in self._agents

    def __iter__(self) -> Iterator[type[Agent]]:
        return iter(sorted(self._agents.values(), key=lambda c: c.name))

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._agents)

    def remove(self, name: str) -> None:
        """Forget an agent (tests)."""
        self._agents.pop(name, None)

    def validate_input(self, name: str, payload: Any) -> Any:
        """Validate ``payload`` against agent ``name``'s input model; return the model.

        Raises:
            UnknownAgent: no such agent.
            InvalidInput: the payload does not match the schema (message lists the errors).

        """
        cls = self.get(name)
        try:
            return cls.input_model.model_validate(payload)
        except ValidationError as exc:
            raise InvalidInput(
                f"payload does not match agent {name!r}'s input schema: "
                + "; ".join(
                    f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}"
                    for e in exc.errors()
                )
            ) from None

    def describe(self) -> list[dict[str, Any]]:
        """Names, types, delegation targets and JSON schemas of every agent."""
        return [
            {
                "name": cls.name,
                "types": list(cls.types),
                "description": cls.description or (cls.__doc__ or "").strip().split("\n")[0],
                "delegates_to": list(cls.delegates_to),
                "input_schema": cls.input_model.model_json_schema(),
                "output_schema": cls.output_model.model_json_schema(),
                "module": cls.__module__,
            }
            for cls in self
        ]


def unknown_message(name: str, known: Iterable[str]) -> str:
    """``unknown agent 'x'; did you mean 'y'?``."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"
    return f"unknown agent {name!r}{hint}"


registry = Registry()


def register(cls: A) -> A:
    """Decorator form of registration (subclassing with a ``name`` registers too)."""
    registry.add(cls)
    return cls


def load_builtins() -> Registry:
    """Import the seed's org (ceo, intel_director, the scouts, judge)."""
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    return registry


def load_modules(modules: Iterable[str]) -> Registry:
    """Import user modules that define agents (or policies); errors name the module.

    The current directory is put on ``sys.path`` first (as uvicorn does), so
    ``--agents-module my_agents`` finds ``./my_agents.py`` from the ``orgchart`` script too.
    """
    load_builtins()
    modules = list(modules)
    if modules and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(f"cannot import agents module {module!r}: {exc}") from exc
    return registry
