"""The project's types hold: mypy as ``make lint`` runs it (pyproject's ``[tool.mypy]``).

``agents/`` and ``runtime/llm/`` are checked with ``--strict``'s flags (issue 46: what
users subclass, and the path of every model call); the rest with the project's defaults.
Run here so that CI, which runs the tests, refuses a change that breaks them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)  # the config names its packages from the repository's root
    out, err, status = api.run(["--config-file", str(REPO_ROOT / "pyproject.toml"),
                                "--cache-dir", str(REPO_ROOT / ".mypy_cache")])
    assert status == 0, out + err
