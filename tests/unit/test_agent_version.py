"""An agent's default version: the hash of the source that was loaded, made on first read."""

from __future__ import annotations

import importlib.util
import linecache
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import tests.support_agents  # noqa: F401  (registers the support agents)
from agents.loader import load_builtins
from agents.registry import registry
from runtime.engine import agent_version as version_module
from runtime.engine.agent_version import agent_version, source_version


def test_every_registered_agent_has_the_hash_inspect_gives() -> None:
    load_builtins()
    names = registry.names()
    assert len(names) >= 10
    for name in names:
        cls = registry.get(name)
        if "version" in vars(cls) and isinstance(vars(cls)["version"], str):
            continue  # named by its author
        assert agent_version(cls) == source_version(cls), name


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
    assert agent_version(cls) == expected
    assert agent_version(local) == expected_local


def test_threads_reading_a_new_version_at_once_make_it_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's first batch reads the version in many threads: one parse, one answer.

    Parsing a module in many threads at once raised ``SystemError`` on CPython 3.11 (a
    thousand leaves in ``test_tree_budget``); the version is now made under a lock. The
    slow maker below gives every thread the time to find it unmade without the lock.
    """
    path = tmp_path / "threaded_agent.py"
    path.write_text(SOURCE)
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    cls = _load(path, "threaded_agent").Outer.Edited  # type: ignore[attr-defined]
    made: list[str] = []
    real = version_module.lines_version

    def slow(cls: type, lines: list[str]) -> str:
        made.append(cls.__qualname__)
        time.sleep(0.05)
        return real(cls, lines)

    monkeypatch.setattr(version_module, "lines_version", slow)
    start = threading.Barrier(16)

    def read(_: int) -> str:
        start.wait()
        return agent_version(cls)

    with ThreadPoolExecutor(max_workers=16) as pool:
        versions = set(pool.map(read, range(16)))
    assert made == ["Outer.Edited"]
    assert versions == {source_version(cls)}
