"""The one generic registry behind agents and policy rules."""

from __future__ import annotations

import pytest

from agents import registry as agents_registry
from agents.loader import load_builtins
from agents.registry import DuplicateAgent, UnknownAgent
from policies import base as policies_base
from policies import builtin as _builtin_rules  # noqa: F401  (registers the built-ins)
from policies.base import DuplicatePolicy, UnknownPolicy
from runtime.registry import Registry


class _Error(LookupError):
    pass


class _Taken(ValueError):
    pass


def _named(name: str, module: str) -> type:
    return type("Thing", (), {"name": name, "__module__": module})


def test_agents_and_policies_share_the_generic_registry() -> None:
    assert isinstance(agents_registry.registry, Registry)
    assert isinstance(policies_base.registry, Registry)


def test_a_duplicate_name_names_both_definitions() -> None:
    things: Registry[type] = Registry("thing", _Error, _Taken)
    things.add(_named("scout", "a.one"))
    things.add(_named("scout", "a.one"))  # the same class again (a re-import) is fine
    with pytest.raises(_Taken, match=r"thing name 'scout' is already registered by "
                                     r"a\.one\.Thing; b\.two\.Thing cannot register it too"):
        things.add(_named("scout", "b.two"))


def test_an_unknown_name_suggests_the_closest() -> None:
    things: Registry[type] = Registry("thing", _Error, _Taken)
    for name in ("intel_director", "judge"):
        things.add(_named(name, "m"))
    with pytest.raises(_Error, match=r"unknown thing 'inteldirector'; did you mean "
                                     r"'intel_director'\?"):
        things.get("inteldirector")
    with pytest.raises(_Error, match=r"unknown thing 'zzz' \(known: intel_director, judge\)"):
        things.get("zzz")
    assert things.names() == ["intel_director", "judge"] and "judge" in things


def test_agent_and_rule_errors_keep_their_own_types() -> None:
    agents = load_builtins()
    with pytest.raises(UnknownAgent, match="did you mean 'judge'"):
        agents.get("jduge")
    with pytest.raises(DuplicateAgent, match="agent name 'judge' is already registered"):
        agents.add(type("Judge", (), {"name": "judge", "__module__": "elsewhere"}))
    with pytest.raises(UnknownPolicy, match="unknown policy rule 'max_dept'; did you mean"):
        policies_base.registry.get("max_dept")
    with pytest.raises(DuplicatePolicy, match="policy rule name 'max_depth'"):
        policies_base.registry.add(type("X", (), {"name": "max_depth", "__module__": "x"}))
