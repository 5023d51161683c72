"""The seed's org through `orgchart run` against a server that misbehaves as small models do.

Every 3rd structured reply is broken JSON, every 5th has the wrong shape, every 7th chat
request answers 500: each run still ends `done` (three roots out of three), and the
repairs and retries are visible in `orgchart show` and counted in `orgchart metrics`.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
GOALS = ("Assess the market for durable agent runtimes",
         "Size the market for warehouse robots in Europe",
         "Map the competitors of a small CRM vendor")


def orgchart(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli.app", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def nodes(tree: dict[str, Any]) -> list[dict[str, Any]]:
    out = [tree]
    for child in tree["children"]:
        out += nodes(child)
    return out


def test_the_seed_org_ends_done_against_a_misbehaving_server(
        orgchart_env: dict[str, str], fake_ollama: FakeOllama) -> None:
    fake_ollama.every_call = {7: "500"}
    fake_ollama.every_structured = {3: "broken_json", 5: "wrong_shape"}
    env = {**orgchart_env, "ORGCHART_LLM__BACKEND": "ollama",
           "ORGCHART_OLLAMA__URL": fake_ollama.url,
           "ORGCHART_LLM__RETRY_BASE_SECONDS": "0.05"}
    roots = []
    unlucky = 0
    for goal in GOALS:
        res = orgchart(env, "run", goal, "--json")
        assert res.returncode == 0, res.stderr + res.stdout[-2000:]
        tree = json.loads(res.stdout)
        assert tree["status"] == "done", [(n["agent"], n["status"], n["error"])
                                          for n in nodes(tree)]
        # With three leaves asking at once, one leaf's requests interleave with the
        # others' on the server's counters: a leaf can draw three bad replies in a row and
        # fail after its repairs (the director carries on without it). Nothing else fails.
        for n in nodes(tree):
            assert n["status"] == "done" or "gave no reply that fits" in str(n["error"]), n
        unlucky += sum(n["status"] != "done" for n in nodes(tree))
        roots.append(tree)
    assert len(roots) == 3
    print(f"leaves that exhausted their repairs: {unlucky}; modes served: "
          f"{dict(fake_ollama.modes)}")
    # The server did misbehave, and every misbehaviour was absorbed inside a call.
    assert fake_ollama.modes["broken_json"] and fake_ollama.modes["wrong_shape"]
    assert fake_ollama.modes["500"]
    res = orgchart(env, "metrics", "--json")
    assert res.returncode == 0, res.stderr
    metrics = json.loads(res.stdout)
    # Every bad reply was followed by a repair, except the last of a call out of repairs;
    # a repair request that met a 500 is a repair row too (and its retry a retry row).
    bad = fake_ollama.modes["broken_json"] + fake_ollama.modes["wrong_shape"]
    assert bad - unlucky <= metrics["model_repairs"] <= bad - unlucky + fake_ollama.modes["500"]
    assert metrics["model_retries"] == fake_ollama.modes["500"]
    # `orgchart show` lists the repaired and retried requests of a task.
    shown = []
    for root in roots:
        for node in nodes(root):
            res = orgchart(env, "show", node["id"], "--json")
            assert res.returncode == 0, res.stderr
            shown += json.loads(res.stdout)["model_calls"]
    kinds = {c["attempt_kind"] for c in shown}
    assert {"call", "repair", "retry"} <= kinds
    # Every request before a repair or a retry failed, and says why.
    assert all(c["error"] for c, nxt in itertools.pairwise(shown)
               if nxt["attempt_kind"] in ("repair", "retry") and nxt["call_try"] > 1)
    repaired = [c for c in shown if c["attempt_kind"] == "repair"]
    assert len(repaired) == metrics["model_repairs"]
