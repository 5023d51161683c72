"""The README's quick start and docs/client.md's example, from a fresh clone, as a user runs them.

A clone of the committed tree (``git clone`` of this repository's HEAD) in a directory of
its own: ``make demo`` creates its ``.venv`` with the package alone, starts an embedded
PostgreSQL under the clone's ``./.orgchart`` (no database URL is set) and runs the seed's
tree with ``auto`` (no Ollama answers here, and the fresh venv has no embedded model, so
the offline backend); then the client example of docs/client.md runs with that venv's
Python, on the same embedded server. Slow (a venv is installed), and it needs ``git``,
``make`` and the package index; it skips, saying why, without them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r'^```python title="(?P<title>[^"]+)"\n(?P<code>.*?)^```$', re.M | re.S)


def _user_env() -> dict[str, str]:
    """The environment of a user with no database, no configuration and no model server."""
    drop = ("ORGCHART_", "DATABASE_URL", "PYTHONPATH", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def test_the_quick_start_and_the_client_example_run_from_a_fresh_clone(open_tmp: Path) -> None:
    for tool in ("git", "make"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    clone = open_tmp / "orgchart"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)],
                   check=True, timeout=120)
    env = _user_env()
    demo = subprocess.run(["make", "demo"], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert demo.returncode == 0, (demo.stdout[-3000:], demo.stderr[-3000:])
    assert "done" in demo.stdout

    text = (clone / "docs" / "client.md").read_text(encoding="utf-8")
    (example,) = [m["code"] for m in FENCE.finditer(text) if m["title"] == "client_example.py"]
    (clone / "client_example.py").write_text(example, encoding="utf-8")
    ran = subprocess.run([str(clone / ".venv" / "bin" / "python"), "client_example.py"],
                         cwd=clone, env={**env, "ORGCHART_LLM__BACKEND": "offline"},
                         capture_output=True, text=True, timeout=300, check=False)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.splitlines()[0] == "done"
    # No embedded server is left running: each process releases it when it exits.
    left = subprocess.run(["pgrep", "-f", f"{clone}/.orgchart/pgdata"],
                          capture_output=True, text=True, check=False)
    assert left.stdout.strip() == "", f"an embedded server was left running: {left.stdout}"
