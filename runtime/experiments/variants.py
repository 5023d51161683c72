"""Variants: what an experiment changes, read from a TOML file, checked before anything runs.

One table per variant::

    [variants.critic_v2]
    agents = { critic = "critic_v2" }   # run this registered agent wherever that one runs
    model = "qwen3:14b"                 # every call of the tree (a priced model)

The ``baseline`` variant (no overrides) is always run first; every other variant of a
case is a fork of the baseline's tree (:mod:`runtime.forks`), so a call whose question did
not change is replayed from the baseline's record, charged zero. ``prompts`` and
``settings`` overrides are refused with a clear error: a tree cannot yet carry its own
prompt folder or settings.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.registry import Registry, UnknownAgent
from runtime.config import Settings
from runtime.errors import BadInput
from runtime.forks.branch import known_models

#: The variant every experiment runs, and the one the others are compared with.
BASELINE = "baseline"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KEYS = frozenset({"agents", "model", "description"})
_NOT_YET = {"prompts": "a tree cannot carry its own prompt folder yet",
            "settings": "settings cannot be set per tree yet"}


@dataclass(frozen=True)
class Variant:
    """One variant: agents swapped tree-wide and the model of every call."""

    name: str
    agents: dict[str, str] = field(default_factory=dict)
    model: str | None = None
    description: str | None = None

    @property
    def is_baseline(self) -> bool:
        """True for the variant with no overrides that every other one is compared with."""
        return self.name == BASELINE

    def as_json(self) -> dict[str, Any]:
        """The variant as stored with its experiment."""
        return {"name": self.name, "agents": dict(self.agents), "model": self.model,
                "description": self.description}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Variant:
        """A variant stored by :meth:`as_json`."""
        return cls(data["name"], dict(data.get("agents") or {}), data.get("model"),
                   data.get("description"))


def _variant(name: str, table: Any, where: str) -> Variant:
    if not _NAME.fullmatch(name):
        raise BadInput(f"{where}: variant name {name!r} must be 1-64 letters, digits, _ . -")
    if not isinstance(table, dict):
        raise BadInput(f"{where}: [variants.{name}] must be a table")
    for key in table:
        if key in _NOT_YET:
            raise BadInput(f"{where}: [variants.{name}] {key}: not supported ({_NOT_YET[key]})")
        if key not in _KEYS:
            raise BadInput(f"{where}: [variants.{name}] unknown key {key!r} "
                           f"(a variant has {', '.join(sorted(_KEYS))})")
    agents = table.get("agents", {})
    if not isinstance(agents, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in agents.items()):
        raise BadInput(f"{where}: [variants.{name}] agents must map agent names to names")
    model = table.get("model")
    if model is not None and not isinstance(model, str):
        raise BadInput(f"{where}: [variants.{name}] model must be a string")
    if name == BASELINE and (agents or model):
        raise BadInput(f"{where}: the {BASELINE!r} variant is the one with no overrides")
    return Variant(name, dict(agents), model, table.get("description"))


def parse_variants(text: str, source: str = "<variants>") -> list[Variant]:
    """Parse a variants file; the baseline comes first whether listed or not."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{source}: malformed TOML ({exc})") from None
    unknown = sorted(set(data) - {"variants"})
    if unknown:
        raise BadInput(f"{source}: unknown table {unknown[0]!r} (write [variants.NAME])")
    tables = data.get("variants", {})
    if not isinstance(tables, dict):
        raise BadInput(f"{source}: 'variants' must be tables: [variants.NAME]")
    variants = [_variant(name, table, source) for name, table in tables.items()]
    named = [v for v in variants if not v.is_baseline]
    return [Variant(BASELINE), *named]


def read_variants(path: Path | None) -> list[Variant]:
    """Read a variants file (only the baseline without one)."""
    if path is None:
        return [Variant(BASELINE)]
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot read variants {path}: {exc.strerror or exc}") from None
    return parse_variants(text, str(path))


def check_variants(variants: list[Variant], registry: Registry, settings: Settings) -> None:
    """Every agent a variant names is registered, and every model has a price."""
    priced = known_models(settings)
    for v in variants:
        for old, new in v.agents.items():
            for role, agent in (("replaces", old), ("runs", new)):
                try:
                    registry.get(agent)
                except UnknownAgent as exc:  # its message suggests the closest name
                    raise BadInput(f"variant {v.name!r} {role} {agent!r}: {exc}") from None
        if v.model is not None and v.model not in priced:
            raise BadInput(f"variant {v.name!r}: unknown model {v.model!r} (name one with a "
                           f"price: {', '.join(sorted(priced)) or 'none configured'})")
