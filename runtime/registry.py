"""One generic registry of named classes, used for agents and for policy rules.

``Registry[T]`` maps a class's ``name`` to the class. Registering a second, different
class under a taken name raises the registry's duplicate error naming both definitions;
asking for an unknown name raises its unknown error suggesting the closest registered
name (Oban's ``validate/1``, pydantic-ai's ``add_tool``). Re-registering the same class
(a module imported twice) is allowed.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


def qualname(cls: type) -> str:
    """``module.Class`` of a class, as error messages name it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def unknown_message(kind: str, name: str, known: Iterable[str]) -> str:
    """``unknown KIND 'x'; did you mean 'y'?`` (or the known names when none is close)."""
    names = sorted(known)
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(names)})"
    return f"unknown {kind} {name!r}{hint}"


class Registry(Generic[T]):
    """Classes by their ``name`` attribute, in registration order.

    Args:
        kind: what the classes are, for messages (``"agent"``, ``"policy rule"``).
        unknown: the error :meth:`get` raises for an unknown name.
        duplicate: the error :meth:`add` raises when a name is taken by another class.

    """

    def __init__(self, kind: str, unknown: type[LookupError],
                 duplicate: type[ValueError]) -> None:
        self.kind = kind
        self._unknown = unknown
        self._duplicate = duplicate
        self._items: dict[str, T] = {}

    def add(self, cls: T) -> T:
        """Register ``cls`` under ``cls.name``; return it (decorator-friendly).

        Raises:
            ValueError: ``cls`` has no name.
            duplicate: another class already has that name (both are named).

        """
        name = getattr(cls, "name", None)
        if not name:
            raise ValueError(f"{qualname(cls)} has no name")
        existing = self._items.get(name)
        if existing is not None and qualname(existing) != qualname(cls):
            raise self._duplicate(
                f"{self.kind} name {name!r} is already registered by {qualname(existing)}; "
                f"{qualname(cls)} cannot register it too"
            )
        self._items[name] = cls
        return cls

    def get(self, name: str) -> T:
        """Return the class registered as ``name``.

        Raises:
            unknown: no such name; the message suggests the closest registered one.

        """
        try:
            return self._items[name]
        except KeyError:
            raise self._unknown(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        """The message :meth:`get` raises for ``name``."""
        return unknown_message(self.kind, name, self._items)

    def remove(self, name: str) -> None:
        """Forget a name (tests)."""
        self._items.pop(name, None)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items.values()))

    def __len__(self) -> int:
        return len(self._items)
