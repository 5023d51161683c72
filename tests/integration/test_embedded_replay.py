"""A real model's run of the seed's tree, replayed: real model text in every ``make test``.

``tests/data/embedded_seed_run.jsonl`` was recorded (``orgchart llm record``) from
``ORGCHART_LLM__BACKEND=embedded orgchart run "Assess the market for durable agent
runtimes"`` on SmolLM2-135M-Instruct (llama.cpp, this machine's kind); the replay backend
serves it without the model, so this test needs no extra. A change to the seed's prompts,
schemas or tools changes the requests and the replay misses: record the run again (the
README's embedded model, then ``orgchart llm record ROOT_ID --out`` this file).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "tests" / "data" / "embedded_seed_run.jsonl"
GOAL = "Assess the market for durable agent runtimes"


def nodes(tree: dict[str, Any]) -> list[dict[str, Any]]:
    out = [tree]
    for child in tree["children"]:
        out += nodes(child)
    return out


def test_the_recorded_real_run_replays_without_the_model(orgchart_env: dict[str, str]) -> None:
    records = [json.loads(line) for line in RECORD.read_text(encoding="utf-8").splitlines()]
    assert {r["backend"] for r in records} == {"embedded"}  # a real model's text, not offline
    env = {**orgchart_env, "ORGCHART_LLM__BACKEND": "replay",
           "ORGCHART_LLM__REPLAY_FILE": str(RECORD)}
    run = subprocess.run([sys.executable, "-m", "runtime.cli.app", "run", GOAL, "--json"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=180,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"replaying {len(records)} recorded responses" in run.stderr
    root = json.loads(run.stdout)
    assert root["status"] == "done", root.get("error")
    shown = subprocess.run([sys.executable, "-m", "runtime.cli.app", "tree", root["id"],
                            "--json"], env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=60, check=False)
    tree = json.loads(shown.stdout)
    assert [n["status"] for n in nodes(tree)] == ["done"] * 5
    # The report is the model's words, served again: the CEO's recorded final answer.
    final = json.loads(records[-1]["response"])
    assert root["result"]["summary"] == final["summary"]
    assert root["result"]["offline"] is False
