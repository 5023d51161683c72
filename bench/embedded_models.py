"""Two GGUF models on the embedded backend, on one dataset, scored without a strong judge.

A 135M judge cannot grade a 270M writer, so each tree is scored by what needs no judge
(each part in 0..1, the tree's score their mean):

- ``done``: the root ended ``done``;
- ``first_try``: no call of the tree needed a repair (every structured reply fitted the
  first time);
- ``key_words``: the share of the goal's key words (four letters or more, common words
  left out) found in the answer;
- ``distinct``: the share of the answer's list items that are distinct (a small model
  repeats one item);
- ``clean``: the share of the answer's strings that read as text: three letters or more
  and no JSON fragment (``][``, ``{``, ``}``, ``<``).

Each model runs the dataset as an experiment of its own (``orgchart experiment run``, in a
scratch database; ``ORGCHART_EMBEDDED__MODEL`` names the file; one tree at a time), the
models one after the other or at once (``--parallel``). The report gives each model's
mean score with its 95% bootstrap interval, the mean per-case difference against the
first model with its paired interval, each part's mean, and time: the model's seconds per
tree (its calls' durations), the trees' mean latency (from the experiment's start: they
queue) and the experiment's wall time, with the load average around.

    python -m bench.embedded_models --model smollm2= --model gemma3=/path/to/gemma.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, open_store, report, scratch_database, worker_env

DATASET = Path(__file__).with_name("data") / "embedded_goals.jsonl"
#: Words a goal's key words leave out.
COMMON = frozenset({"assess", "market", "find", "whether", "should", "decide", "about",
                    "their", "which", "what", "with", "from", "into", "that", "this",
                    "main", "plan", "size", "work", "does", "over"})
FRAGMENT = re.compile(r"\]\s*\[|[{}<]")
PARTS = ("done", "first_try", "key_words", "distinct", "clean")


def key_words(goal: str) -> set[str]:
    """The goal's words of four letters or more, common ones left out."""
    return {w for w in re.findall(r"[a-z][a-z-]{3,}", goal.lower()) if w not in COMMON}


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _list_items(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _list_items(v)]
    if isinstance(value, list):
        return [json.dumps(v, sort_keys=True).lower().strip() for v in value]
    return []


def tree_parts(goal: str, status: str, result: Any, repairs: int) -> dict[str, float]:
    """The parts of one tree's score (each 0..1)."""
    answer = {k: v for k, v in (result or {}).items()
              if k not in ("offline", "tool_notes")} if isinstance(result, dict) else {}
    text = " ".join(_strings(answer)).lower()
    words = key_words(goal)
    items = _list_items(answer)
    strings = _strings(answer)
    clean = [s for s in strings
             if len(re.findall(r"[A-Za-z]", s)) >= 3 and not FRAGMENT.search(s)]
    return {"done": float(status == "done"), "first_try": float(repairs == 0),
            "key_words": sum(1 for w in words if w in text) / len(words) if words else 1.0,
            "distinct": len(set(items)) / len(items) if items else 1.0,
            "clean": len(clean) / len(strings) if strings else 0.0}


def bootstrap(values: Sequence[float], rounds: int = 2000, seed: int = 7) -> list[float]:
    """The 95% percentile-bootstrap interval of the mean."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values)))
                   for _ in range(rounds))
    return [round(means[int(0.025 * rounds)], 3), round(means[int(0.975 * rounds) - 1], 3)]


def run_model(label: str, model: str, dataset: Path, server: str | None) -> dict[str, Any]:
    """Run the dataset on one model in a scratch database; score each tree."""
    with scratch_database(f"emb_{label}", server) as url:
        # One tree at a time: the model has one slot, and trees waiting for it on a busy
        # machine ran past their budget_seconds (300 s) and failed for the machine's sake.
        env = {**worker_env(url), "ORGCHART_LLM__BACKEND": "embedded",
               "ORGCHART_WORKER__MAX_IN_FLIGHT": "1", "ORGCHART_WORKER__SYNC_THREADS": "1"}
        if model:
            env["ORGCHART_EMBEDDED__MODEL"] = model
        load = os.getloadavg()[0]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", "from runtime.cli.app import main; main()", "experiment",
             "run", str(dataset), "--name", label, "--json", "--timeout", "7200"],
            env=env, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=7800,
            check=False)
        wall = time.monotonic() - started
        if done.returncode not in (0, 1):
            raise RuntimeError(f"experiment {label} failed: {done.stderr[-2000:]}")
        store = open_store(url)
        try:
            experiment = store.experiments.get(label)
            if experiment is None:
                raise RuntimeError(f"experiment {label} did not start: {done.stderr[-2000:]}")
            cases = store.experiments.dataset_cases(experiment["dataset_id"])
            trees = []
            for row in store.experiments.runs(experiment["id"]):
                calls = store.database.query("model_call_list_tree", root_id=row["root_id"])
                goal = cases[row["position"]]["payload"]["goal"]
                repairs = sum(1 for c in calls if c["attempt_kind"] == "repair")
                trees.append({
                    "case": row["position"], "goal": goal, "status": row["status"],
                    "latency_s": (row["completed_at"] - row["created_at"]).total_seconds()
                    if row["completed_at"] else None,
                    "tokens": int(row["tokens"]), "repairs": repairs,
                    "call_seconds": round(sum(float(c["duration_seconds"] or 0)
                                                       for c in calls), 1),
                    "parts": tree_parts(goal, row["status"], row["result"], repairs),
                    "result": row["result"]})
        finally:
            store.engine.dispose()
    return {"label": label, "wall_s": round(wall, 1), "trees": trees,
            "load_average": [round(load, 2), round(os.getloadavg()[0], 2)]}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each model's mean score and interval, parts, time; the difference to the first."""
    out: dict[str, Any] = {}
    base = {t["case"]: statistics.fmean(t["parts"].values()) for t in runs[0]["trees"]}
    for run in runs:
        scores = {t["case"]: statistics.fmean(t["parts"].values()) for t in run["trees"]}
        latencies = [t["latency_s"] for t in run["trees"] if t["latency_s"] is not None]
        row: dict[str, Any] = {
            "trees": len(scores), "score": round(statistics.fmean(scores.values()), 3),
            "score_ci": bootstrap(list(scores.values())),
            "parts": {p: round(statistics.fmean(t["parts"][p] for t in run["trees"]), 3)
                      for p in PARTS},
            "repairs": sum(t["repairs"] for t in run["trees"]),
            "tokens": sum(t["tokens"] for t in run["trees"]),
            "mean_latency_s": round(statistics.fmean(latencies), 1) if latencies else None,
            "mean_call_seconds": round(statistics.fmean(
                t.get("call_seconds", 0) for t in run["trees"]), 1),
            "wall_s": run["wall_s"], "load_average": run["load_average"]}
        if run is not runs[0]:
            diffs = [scores[c] - base[c] for c in scores if c in base]
            row["diff_vs_first"] = round(statistics.fmean(diffs), 3)
            row["diff_ci"] = bootstrap(diffs)
        out[run["label"]] = row
    return out


def main(models: list[tuple[str, str]], dataset: Path = DATASET, parallel: bool = False,
         server: str | None = None) -> dict[str, Any]:
    """Run and score every model; print and return the summary."""
    if parallel:  # one process per model (migrations in threads of one process collide)
        outs = [Path(f"/tmp/embedded_models_{os.getpid()}_{label}.json") for label, _ in models]
        procs = [subprocess.Popen([sys.executable, "-m", "bench.embedded_models", "--model",
                                            f"{label}={path}", "--dataset", str(dataset),
                                            "--raw-out", str(out)], cwd=str(REPO_ROOT))
                 for (label, path), out in zip(models, outs, strict=True)]
        for proc in procs:
            proc.wait()
        runs = [json.loads(out.read_text()) for out in outs]
    else:
        runs = [run_model(label, path, dataset, server) for label, path in models]
    figures = summary(runs)
    samples = {r["label"]: [t["result"] for t in r["trees"][:2]] for r in runs}
    report("embedded_models", {**figures, "sample_answers": samples})
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True,
                        help="LABEL=PATH (an empty PATH: the packaged default)")
    parser.add_argument("--dataset", type=Path, default=DATASET)
    parser.add_argument("--parallel", action="store_true")
    parser.add_argument("--raw-out", type=Path, help="run one model; write its trees here")
    args = parser.parse_args()
    if args.raw_out:
        label, path = args.model[0].split("=", 1)
        args.raw_out.write_text(json.dumps(run_model(label, path, args.dataset, None),
                                                    default=str))
    else:
            main([tuple(m.split("=", 1)) for m in args.model],  # type: ignore[misc]
             args.dataset, args.parallel)
