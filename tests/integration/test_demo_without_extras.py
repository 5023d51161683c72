"""The demo path needs none of the dev or bench extras (issue 45, item 13).

``make demo`` installs the package alone (``pip install -e .``): the demo's command,
``orgchart run GOAL``, must run a tree to ``done`` with every module of the extras
(pytest, LangGraph, DBOS, Playwright, scipy, schemathesis...) unimportable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: The top-level modules of the ``dev`` and ``bench`` extras of pyproject.toml that the
#: package itself does not require.
EXTRAS = ("pytest", "hypothesis", "playwright", "scipy", "standardwebhooks", "schemathesis",
          "pgqueuer", "asyncpg", "langgraph", "dbos", "ruff", "mypy")

BLOCKED_RUN = f"""
import importlib.abc, sys
EXTRAS = {EXTRAS!r}

class NoExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in EXTRAS:
            raise ImportError(f"{{name}} is in the dev or bench extras, not in the package")
        return None

sys.meta_path.insert(0, NoExtras())
for name in [m for m in sys.modules if m.split(".")[0] in EXTRAS]:
    del sys.modules[name]
sys.argv = ["orgchart", "run", "Assess the market for durable agent runtimes", "--json"]
from runtime.cli.app import main
main()
"""


def test_the_demo_runs_with_the_extras_unimportable(orgchart_env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-c", BLOCKED_RUN], env=orgchart_env, cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["status"] == "done"
