"""The Makefile's install levels (issue 45, item 13), read with ``make -n`` (nothing runs).

``make demo`` installs the package alone; ``make install`` and ``make test`` the dev and
bench extras too. Each level has its stamp in the venv, so ``make test`` after ``make
demo`` still installs the extras and ``make demo`` after ``make install`` installs nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def dry_run(target: str, venv: Path) -> str:
    done = subprocess.run(["make", "-n", "-C", str(REPO), target, f"VENV={venv}"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def stamp(venv: Path, *levels: str) -> None:
    venv.mkdir(parents=True, exist_ok=True)
    later = (REPO / "pyproject.toml").stat().st_mtime + 60
    for level in levels:
        path = venv / f".installed-{level}"
        path.touch()
        os.utime(path, (later, later))


def test_demo_installs_the_package_alone(tmp_path: Path) -> None:
    plan = dry_run("demo", tmp_path / "venv")
    assert "pip install -q -e .\n" in plan
    assert "[dev" not in plan and "bench]" not in plan
    assert "orgchart run" in plan


def test_test_after_demo_still_installs_the_extras(tmp_path: Path) -> None:
    stamp(tmp_path / "venv", "base")
    assert "pip install" not in dry_run("demo", tmp_path / "venv")
    assert 'pip install -q -e ".[dev,bench]"' in dry_run("test", tmp_path / "venv")


def test_demo_after_install_installs_nothing(tmp_path: Path) -> None:
    stamp(tmp_path / "venv", "base", "dev")
    assert "pip install" not in dry_run("demo", tmp_path / "venv")
    assert "pip install" not in dry_run("test", tmp_path / "venv")


def test_make_help_lists_the_targets() -> None:
    done = subprocess.run(["make", "-C", str(REPO), "help"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0
    names = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    assert {"install", "install-base", "demo", "test"} <= names
