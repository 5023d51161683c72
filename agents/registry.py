"""The agent registry: ``dict[str, type[Agent]]``, filled by subclassing or ``@register``.

A duplicate name raises with both classes named; an unknown name suggests the closest
registered one. :mod:`agents.loader` fills it: the seed's org, then user agents from
importable modules (``--agents-module``, ``[agents] modules``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from agents.tools import described
from runtime.registry import Registry as NamedRegistry

if TYPE_CHECKING:
    from agents.base import Agent

A = TypeVar("A", bound="type[Agent]")

class UnknownAgent(LookupError):
    """No agent is registered under that name."""


class DuplicateAgent(ValueError):
    """Two different classes claim the same agent name."""


class InvalidInput(ValueError):
    """A payload that does not match the agent's input schema."""


class Registry(NamedRegistry["type[Agent]"]):
    """Agent classes by name (the generic :class:`runtime.registry.Registry`), listed sorted."""

    def __init__(self) -> None:
        super().__init__("agent", UnknownAgent, DuplicateAgent)

    def __iter__(self) -> Iterator[type[Agent]]:
        return iter(sorted(super().__iter__(), key=lambda c: c.name))

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
                "tools": described(cls.tools),
                "module": cls.__module__,
            }
            for cls in self
        ]


registry = Registry()


def register(cls: A) -> A:
    """Decorator form of registration (subclassing with a ``name`` registers too)."""
    registry.add(cls)
    return cls
