"""An agent's default version: the hash of the source that was loaded, made on first read."""

from __future__ import annotations

import importlib.util
import linecache
import sys
from pathlib import Path

import pytest

import tests.support_agents  # noqa: F401  (registers the support agents)
from agents.base import source_version
from agents.loader import load_builtins
from agents.registry import registry


def test_every_registered_agent_has_the_hash_inspect_gives() -> None:
    load_builtins()
    names = registry.names()
    assert len(names) >= 10
    for name in names:
        cls = registry.get(name)
        if "version" in vars(cls) and isinstance(vars(cls)["version"], str):
            continue  # named by its author
        assert cls.version == source_version(cls), name


SOURCE = '''
from agents.base import Agent


def decorate(cls):
    return cls


class Outer:
    @decorate
    class Edited(Agent):
        register = False

        def run(self, ctx, task):
            return None


def factory():
    class Local(Agent):
        register = False
    return Local
'''


def _load(path: Path, name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_version_is_of_the_loaded_code_even_if_the_file_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "edited_agent.py"
    path.write_text(SOURCE)
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    module = _load(path, "edited_agent")
    cls = module.Outer.Edited  # type: ignore[attr-defined]
    local = module.factory()  # type: ignore[attr-defined]
    expected = source_version(cls)  # inspect's answer while the file is as loaded
    expected_local = source_version(local)
    # Edited before the first read (and linecache told so): still the loaded code's hash,
    # where a version hashed from the file at that read would be the edited code's.
    path.write_text(SOURCE.replace("return None", "return 'changed'"))
    linecache.checkcache(str(path))
    assert source_version(cls) != expected  # what reading the file now would give
    assert cls.version == expected
    assert local.version == expected_local
