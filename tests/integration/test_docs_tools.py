"""docs/writing-agents.md "Tools and steps" works as written: its example, by the real CLI.

The ```python block titled ``tool_agents.py`` is written to ``tmp_path`` and run with
``orgchart run GOAL --agent librarian --agents-module tool_agents --json`` on the offline
backend (which calls each tool once); ``orgchart show --json`` then lists the tool call
and the step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.test_docs_agents import GOAL, code_blocks


def cli(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.cli.app", *args],
                          env={**env, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_the_docs_librarian_calls_its_tool_and_files_one_note(
        tmp_path: Path, orgchart_env: dict[str, str]) -> None:
    (tmp_path / "tool_agents.py").write_text(code_blocks("tool_agents.py"), encoding="utf-8")
    proc = cli(tmp_path, orgchart_env, "run", GOAL, "--agent", "librarian",
               "--agents-module", "tool_agents", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tree = json.loads(proc.stdout)
    assert tree["status"] == "done", tree
    assert tree["result"]["offline"] is True and len(tree["result"]["counts"]) == 1
    notes = (tmp_path / "notes.txt").read_text().splitlines()
    assert len(notes) == 1 and GOAL in notes[0]
    shown = cli(tmp_path, orgchart_env, "show", tree["id"], "--json")
    assert shown.returncode == 0, shown.stderr
    steps = json.loads(shown.stdout)["steps"]
    assert [(s["kind"], s["name"], s["status"]) for s in steps] == [
        ("tool", "count_words", "finished"), ("step", "file_note", "finished")]
    assert notes[0].startswith(steps[1]["idempotency_key"] + " ")
