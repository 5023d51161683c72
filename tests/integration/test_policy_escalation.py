"""A policy violation escalates a real run end to end: ``orgchart run`` exits 1.

With ``max_depth = 1`` the CEO (depth 0) may delegate to the intel director (depth 1),
but the director may not create scouts at depth 2: its delegation is refused by the
``max_depth`` rule, the director ends ``escalated`` with the rule in its error, no scout
is ever written, and the escalation reaches the root.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

GOAL = "Map the competitive landscape for managed PostgreSQL in Europe"



def walk(tree: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [tree]
    for child in tree.get("children", []):
        nodes += walk(child)
    return nodes


def run(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.cli.app", "run", GOAL, "--json", *extra],
                          env=env, capture_output=True, text=True, timeout=240, check=False)


def test_a_delegation_beyond_max_depth_escalates_the_tree(orgchart_env: dict[str, str]) -> None:
    env = {**orgchart_env, "ORGCHART_POLICIES__MAX_DEPTH": "1"}
    done = run(env)
    assert done.returncode == 1, done.stderr
    tree = json.loads(done.stdout)
    assert tree["status"] == "escalated"
    nodes = walk(tree)
    refused = [n for n in nodes if (n.get("error") or "").startswith("policy max_depth:")]
    assert refused, [(n["agent"], n["status"], n.get("error")) for n in nodes]
    assert all(n["agent"] == "intel_director" for n in refused)
    assert max(len(path) for path in _depths(tree)) == 2  # root and directors only

    # The root waits in the inbox; a person ends it with resolve --fail.
    inbox = subprocess.run([sys.executable, "-m", "runtime.cli.app", "escalations", "--json"],
                           env=env, capture_output=True, text=True, timeout=60, check=False)
    assert inbox.returncode == 0, inbox.stderr
    assert tree["id"] in {e["id"] for e in json.loads(inbox.stdout)}
    resolved = subprocess.run(
        [sys.executable, "-m", "runtime.cli.app", "resolve", tree["id"], "--fail",
         "--note", "too deep for this org"],
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert resolved.returncode == 0, resolved.stderr
    shown = subprocess.run([sys.executable, "-m", "runtime.cli.app", "show", tree["id"], "--json"],
                           env=env, capture_output=True, text=True, timeout=60, check=False)
    task = json.loads(shown.stdout)
    assert task["status"] == "failed"
    assert "too deep for this org" in task["events"][-1]["detail"]
    again = subprocess.run(
        [sys.executable, "-m", "runtime.cli.app", "resolve", tree["id"], "--done"],
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 2 and "not escalated" in again.stderr


def _depths(tree: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    here = (*path, tree["agent"])
    if not tree.get("children"):
        return [here]
    return [p for child in tree["children"] for p in _depths(child, here)]


def test_the_same_goal_passes_with_the_default_depth(orgchart_env: dict[str, str]) -> None:
    done = run(orgchart_env)
    assert done.returncode == 0, done.stderr
    tree = json.loads(done.stdout)
    assert tree["status"] == "done"
    assert not [n for n in walk(tree) if (n.get("error") or "").startswith("policy ")]


def test_malformed_criteria_are_refused_before_anything_is_written(
        orgchart_env: dict[str, str]) -> None:
    done = run(orgchart_env, "--success", '{"checks": [{"path": "a", "op": "=>", "value": 1}]}')
    assert done.returncode == 2
    assert "did you mean '>='" in done.stderr


def test_a_rubric_under_the_offline_backend_escalates_to_a_person(
        orgchart_env: dict[str, str]) -> None:
    rubric = json.dumps({"rubric": {"text": "Every claim cites a source.", "threshold": 0.5}})
    done = run(orgchart_env, "--agent", "trend_analyst", "--success", rubric)
    assert done.returncode == 1, done.stderr
    tree = json.loads(done.stdout)
    assert tree["status"] == "escalated"
    assert tree["verdict"]["offline"] is True
    assert "offline backend" in tree["error"]


def test_a_kill_criterion_escalates_the_root(orgchart_env: dict[str, str]) -> None:
    done = run(orgchart_env, "--agent", "trend_analyst", "--kill",
               '{"deadline": "2000-01-01T00:00:00Z"}')
    assert done.returncode == 1, done.stderr
    tree = json.loads(done.stdout)
    assert tree["status"] == "escalated"
    assert tree["error"].startswith("kill criteria: deadline:")

