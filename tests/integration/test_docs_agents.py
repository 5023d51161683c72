"""docs/writing-agents.md works as written: its code blocks, run by the real CLI.

The ```python blocks titled ``my_agents.py`` are put together, exactly as written, into
``tmp_path/my_agents.py``; ``orgchart run GOAL --agent NAME --agents-module my_agents
--json`` then drains each example agent against a private database on the offline
backend. The block titled ``test_my_agents.py`` is run with pytest.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "writing-agents.md"
GOAL = "first snow on the harbour"
FENCE = re.compile(r'^```python title="(?P<title>[^"]+)"\n(?P<code>.*?)^```$', re.M | re.S)



def code_blocks(title: str) -> str:
    """The doc's python blocks titled ``title``, joined by blank lines."""
    blocks = [m["code"] for m in FENCE.finditer(DOC.read_text(encoding="utf-8"))
              if m["title"] == title]
    assert blocks, f"docs/writing-agents.md has no python block titled {title!r}"
    return "\n\n".join(blocks)


@pytest.fixture
def docs_dir(tmp_path: Path) -> Path:
    (tmp_path / "my_agents.py").write_text(code_blocks("my_agents.py"), encoding="utf-8")
    (tmp_path / "test_my_agents.py").write_text(code_blocks("test_my_agents.py"),
                                                encoding="utf-8")
    return tmp_path


def orgchart_run(docs_dir: Path, env: dict[str, str], agent: str,
                 *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli.app", "run", GOAL, "--agent", agent,
         "--agents-module", "my_agents", "--json", *extra],
        env={**env, "PYTHONPATH": str(docs_dir)}, cwd=docs_dir,
        capture_output=True, text=True, timeout=120,
    )


def finished_tree(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    tree: dict[str, Any] = json.loads(proc.stdout)
    assert tree["status"] == "done", tree
    return tree


def test_the_docs_editor_fans_out_to_three_poets_and_keeps_one(
        docs_dir: Path, orgchart_env: dict[str, str]) -> None:
    tree = finished_tree(orgchart_run(docs_dir, orgchart_env, "haiku_editor"))

    assert tree["agent"] == "haiku_editor"
    assert sorted(c["payload"]["mood"] for c in tree["children"]) == [
        "calm", "melancholy", "playful"]
    assert all(c["status"] == "done" for c in tree["children"])
    assert tree["result"]["poets_answered"] == 3
    assert len(tree["result"]["lines"]) == 3
    assert tree["result"]["offline"] is True
    assert tree["totals"]["by_status"] == {"done": 4}


def test_the_docs_poet_runs_alone_with_a_payload(
        docs_dir: Path, orgchart_env: dict[str, str]) -> None:
    proc = orgchart_run(docs_dir, orgchart_env, "haiku_poet", "--payload", '{"mood": "playful"}')
    tree = finished_tree(proc)

    assert tree["payload"] == {"goal": GOAL, "mood": "playful"}
    assert tree["result"]["mood"] == "playful"
    assert tree["children"] == []


def test_the_docs_unit_tests_pass(docs_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_agents.py"],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
             "PYTHONPATH": str(docs_dir)},
        cwd=docs_dir,
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def test_the_builtin_org_runs_as_the_docs_describe(tmp_path: Path,
                                                   orgchart_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.cli.app", "run", "Should we launch a managed job queue?",
         "--json"],
        env=orgchart_env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    tree = finished_tree(proc)

    assert (tree["agent"], tree["type"]) == ("ceo", "goal")
    [director] = tree["children"]
    assert (director["agent"], director["status"]) == ("intel_director", "done")
    assert sorted(c["agent"] for c in director["children"]) == [
        "competitor_scout", "market_researcher", "trend_analyst"]
    report = tree["result"]
    assert report["sources"] == ["intel_director", "competitor_scout", "market_researcher",
                                 "trend_analyst"]
    assert report["offline"] is True and report["gaps"] == []
    assert set(director["result"]["findings"]) == {"competitors", "market", "trends"}
    assert tree["totals"]["by_status"] == {"done": 5}


def orgchart(docs_dir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.cli.app", *args],
                          env={**env, "PYTHONPATH": str(docs_dir)}, cwd=docs_dir,
                          capture_output=True, text=True, timeout=120)


def test_the_docs_fork_pays_only_for_the_changed_poem(
        docs_dir: Path, orgchart_env: dict[str, str]) -> None:
    """The commands of "Tuning a tree: fork, re-run, diff", as written there."""
    tree = finished_tree(orgchart_run(docs_dir, orgchart_env, "haiku_editor"))
    poet = next(c for c in tree["children"] if c["key"] == "calm")
    text = DOC.read_text(encoding="utf-8")
    assert "orgchart fork POET_ID --payload '{\"goal\": \"first snow on the harbour\", " \
           "\"mood\": \"stormy\"}'" in text

    forked = orgchart(docs_dir, orgchart_env, "fork", poet["id"], "--payload",
                      json.dumps({"goal": GOAL, "mood": "stormy"}), "--note", "a darker take",
                      "--run", "--json", "--agents-module", "my_agents")
    branch = finished_tree(forked)
    assert branch["forked_from"] == tree["id"]
    stormy = next(c for c in branch["children"] if c["key"] == "calm")
    assert stormy["payload"]["mood"] == "stormy" and stormy["result"]["mood"] == "stormy"

    diff = orgchart(docs_dir, orgchart_env, "diff", tree["id"], branch["id"], "--json")
    totals = json.loads(diff.stdout)["totals"]["b"]
    assert (totals["calls_paid"], totals["calls_replayed"]) == (1, 2)
    shown = orgchart(docs_dir, orgchart_env, "diff", tree["id"], branch["id"])
    assert "/calm" in shown.stdout and '"mood": "stormy"' in shown.stdout

    rerun = orgchart(docs_dir, orgchart_env, "fork", tree["id"], "--run", "--json",
                     "--agents-module", "my_agents")
    again = json.loads(orgchart(docs_dir, orgchart_env, "diff", tree["id"],
                                finished_tree(rerun)["id"], "--json").stdout)
    assert (again["totals"]["b"]["calls_paid"], again["totals"]["b"]["calls_replayed"]) == (0, 3)
