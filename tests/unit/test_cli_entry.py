"""The ``orgchart`` entry point pauses the collector for the CLI's import, and only then."""

from __future__ import annotations

import gc
import subprocess
import sys
import types
from collections.abc import Iterator

import pytest

from runtime import cli as entry


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    """``main`` freezes what the process holds; give this test process its collector back."""
    yield None
    gc.unfreeze()


def test_the_command_runs_with_the_collector_back_on(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    stub = types.ModuleType("runtime.cli.app")
    stub.main = lambda: seen.append(gc.isenabled())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "runtime.cli.app", stub)
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    entry.main()
    assert seen == [True] and gc.isenabled()
    assert gc.get_freeze_count() > frozen  # what the import made is out of the collector's way


def test_a_failed_import_leaves_the_collector_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "runtime.cli.app", None)  # import raises ImportError
    with pytest.raises(ImportError):
        entry.main()
    assert gc.isenabled()


def test_a_paused_collector_stays_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = types.ModuleType("runtime.cli.app")
    stub.main = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "runtime.cli.app", stub)
    gc.disable()
    try:
        entry.main()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_python_dash_m_runs_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "runtime.cli", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Usage" in done.stdout and "worker" in done.stdout
