"""Build the active rule set from the configuration: built-ins plus the user's modules.

A rule is active when it is built in, or defined in a module listed in ``[policies]
modules`` (or ``[agents] modules``, or given to ``--agents-module`` on the command line: one
user module may hold agents and rules), or in a submodule of one; unless ``[policies]
disabled`` names it or its own settings switch it off (``delegation_edges = false``, an
empty ``forbidden_patterns``). An unknown name in ``disabled`` is an error suggesting the
closest rule.

:class:`PolicySet` runs the active rules in order and returns the first violation. A
rule that raises is itself a violation (fail closed): a broken check must not wave a
task through.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from policies import base
from policies.base import Policy, Violation, unknown_rule_message
from policies.builtin import BUILTIN_POLICIES, MANDATORY_RULES
from runtime.config import ConfigError

if TYPE_CHECKING:
    from agents.base import ChildSpec, TaskView
    from agents.registry import Registry
    from runtime.config import Settings

log = logging.getLogger(__name__)


#: Types returned as they are, checked by exact type first: ``isinstance`` against
#: ``BaseModel`` goes through its metaclass's ``__instancecheck__`` (Python code), once
#: per value of every result a worker checks.
_PLAIN = frozenset({str, int, float, bool, type(None)})


def to_json_value(value: Any) -> Any:
    """Turn a pydantic model (or containers of them) into plain JSON values."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is dict:
        return {k: to_json_value(v) for k, v in value.items()}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: to_json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_value(v) for v in value]
    return value


class PolicySet:
    """The active rules, run in order; the first violation wins.

    Args:
        policies: rule instances, in the order they run.
        inactive: rules known but switched off, mapped to the reason (for ``describe``).

    """

    def __init__(self, policies: Sequence[Policy],
                 inactive: dict[str, tuple[type[Policy], str]] | None = None) -> None:
        self.policies = list(policies)
        self.inactive = dict(inactive or {})
        self._by_method: dict[str, tuple[list[Policy], list[tuple[Policy, Any]]]] = {}

    def names(self) -> list[str]:
        """Return the active rule names, in order."""
        return [p.name for p in self.policies]

    def get(self, name: str) -> Policy | None:
        """The active rule named ``name``, or None when it is not active."""
        return next((p for p in self.policies if p.name == name), None)

    def __contains__(self, name: object) -> bool:
        return any(p.name == name for p in self.policies)

    def _checks(self, method: str) -> list[tuple[Policy, Any]]:
        """The rules whose class has its own ``method`` (the base's returns None), bound.

        Found once per method and list of rules (every task asks twice); found again when
        ``policies`` changed (a list compares its items by identity first: one C loop).
        """
        found = self._by_method.get(method)
        if found is not None and found[0] == self.policies:
            return found[1]
        base = getattr(Policy, method, None)
        checks = [(p, getattr(p, method)) for p in self.policies
                  if base is None or getattr(type(p), method, None) is not base
                  or method in getattr(p, "__dict__", {})]
        self._by_method[method] = (list(self.policies), checks)
        return checks

    def _first(self, method: str, *args: Any) -> Violation | None:
        for policy, check in self._checks(method):
            try:
                found = check(*args)
            except Exception as exc:  # a broken rule fails closed
                log.exception("policy raised", extra={"rule": policy.name, "check": method})
                return Violation(policy.name, f"the rule itself raised {type(exc).__name__}: {exc}")
            if found is not None:
                if not isinstance(found, Violation):
                    return Violation(policy.name, f"{method} returned {found!r}, not a Violation")
                return found
        return None

    def validate_input(self, task: TaskView) -> Violation | None:
        """Check a task before its agent runs."""
        return self._first("validate_input", task)

    def validate_output(self, task: TaskView, result: Any) -> Violation | None:
        """Check a result (pydantic models are turned into plain JSON first)."""
        return self._first("validate_output", task, to_json_value(result))

    def validate_delegation(self, parent: TaskView, children: list[ChildSpec]) -> Violation | None:
        """Check the children a task wants to create."""
        return self._first("validate_delegation", parent, list(children))

    def validate_tool(self, task: TaskView, tool: str) -> Violation | None:
        """Check a tool call before it runs (``allowed_tools``)."""
        return self._first("validate_tool", task, tool)

    def describe(self) -> list[dict[str, Any]]:
        """Every known rule: name, description, source module, active or why not, settings."""
        rows = [_describe(type(p), True, None, p.settings_view()) for p in self.policies]
        rows += [_describe(cls, False, why, {}) for cls, why in self.inactive.values()]
        return rows


def _describe(cls: type[Policy], active: bool, reason: str | None,
              settings: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": cls.name,
        "description": cls.description or (cls.__doc__ or "").strip().split("\n")[0],
        "source": "builtin" if cls in BUILTIN_POLICIES else cls.__module__,
        "active": active,
        "settings": settings,
    }
    if reason:
        row["inactive_reason"] = reason
    return row


def _in_modules(cls: type[Policy], modules: Iterable[str]) -> bool:
    return any(cls.__module__ == m or cls.__module__.startswith(m + ".") for m in modules)


def import_policy_modules(modules: Iterable[str], where: str = "[policies] modules") -> None:
    """Import the user's rule modules.

    Args:
        modules: the module names.
        where: where they were named, for the error (``--agents-module``...).

    Raises:
        ConfigError: a module cannot be imported (the module and the reason are named).

    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"{where}: cannot import {module!r}: {exc}") from exc


def load_policy_set(settings: Settings, registry: Registry | None,
                    extra_modules: Sequence[str] = ()) -> PolicySet:
    """Build the active rule set for ``settings``.

    Args:
        settings: the configuration (``[policies]`` and, for ``model_price``, ``[cost]``).
        registry: the agent registry, for rules that look at agent classes.
        extra_modules: the modules given to ``--agents-module``: their rules are on too
            (the option imports "agents (and policies)"; a rule imported but off would be
            a safety check silently skipped).

    Raises:
        ConfigError: a module cannot be imported, ``disabled`` names an unknown or a
            mandatory rule, or a rule cannot start with its settings.

    """
    import_policy_modules(settings.policies.modules)
    import_policy_modules(extra_modules, "--agents-module")
    user_modules = [*settings.policies.modules, *settings.agents.modules, *extra_modules]
    candidates: list[type[Policy]] = list(BUILTIN_POLICIES)
    candidates += [
        cls for cls in base.registry
        if cls not in BUILTIN_POLICIES and _in_modules(cls, user_modules)
    ]
    known = [cls.name for cls in candidates]
    disabled = set(settings.policies.disabled)
    for name in settings.policies.disabled:
        if name not in known:
            raise ConfigError(f"[policies] disabled: {unknown_rule_message(name, known)}")
        if name in MANDATORY_RULES:
            raise ConfigError(
                f"[policies] disabled: rule {name!r} cannot be disabled: {MANDATORY_RULES[name]}"
            )
    active: list[Policy] = []
    inactive: dict[str, tuple[type[Policy], str]] = {}
    for cls in candidates:
        reason = "[policies] disabled" if cls.name in disabled else cls.inactive_reason(settings)
        if reason:
            inactive[cls.name] = (cls, reason)
            continue
        try:
            policy = cls(settings)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"policy rule {cls.name!r} ({cls.__module__}) cannot start: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        policy.agents = registry
        active.append(policy)
    return PolicySet(active, inactive)
