"""Filling the agent registry: the seed's org, then the user's modules by configured name.

The seed's org is imported here statically (importing a module that defines an ``Agent``
subclass registers it), so the import graph, and the layout test, see it. User modules
(``--agents-module``, ``[agents] modules``) are named in configuration: they are the one
place agents are imported by name.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable

from agents import ceo, intel_director, judge, scouts
from agents.registry import Registry, registry

#: The modules of the seed's org (ceo, intel_director, the scouts, judge). The built-in
#: agent ``human`` (a person) is defined with ``Agent`` itself, in agents/base.py.
BUILTIN_MODULES: tuple[str, ...] = tuple(
    module.__name__ for module in (ceo, intel_director, scouts, judge))


def load_builtins() -> Registry:
    """The registry holding the seed's org (imported with this module)."""
    return registry


def load_modules(modules: Iterable[str]) -> Registry:
    """The seed's org plus user modules that define agents (or policies); errors name the module.

    The current directory is put on ``sys.path`` first (as uvicorn does), so
    ``--agents-module my_agents`` finds ``./my_agents.py`` from the ``orgchart`` script too.
    """
    modules = list(modules)
    if modules and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(f"cannot import agents module {module!r}: {exc}") from exc
    return registry
