"""Experiments: what a variant pays, what the runner adds, how long a rescore takes.

    python -m bench.experiments [--cases 20] [--delay 0.05]

The seed's org answers ``--cases`` goals under the baseline and one variant that swaps the
trend analyst for ``trend_analyst_v2`` (docs/examples/experiments: one scout's prompt
changes). The model is the loopback Ollama-compatible server of the tests
(``tests.fake_ollama``: schema-valid answers, ``--delay`` seconds a call), which counts
the requests it answers; a worker runs in this process, as ``orgchart experiment run``'s.

- ``experiment_paid_fraction``: the variant's calls paid at the server over the
  baseline's; ``experiment_changed_fraction``: the share of them that really changed,
  told by the server alone: the variant's requests whose question (model, messages,
  format, options) the baseline never asked. The goal is that the two are equal: no call
  asked again (``experiment_asked_again`` counts them; goal 0).
  ``experiment_reachable_fraction`` is the share of the baseline's calls the change
  could reach (the swapped scout's calls, the aggregate and judge calls of its
  ancestors): an upper bound, reached when the new answer differs and changes every
  prompt above it (the loopback server's answers depend on the schema more than on the
  prompt, so fewer change here).
- ``experiment_replayed_calls`` (the report's) against ``experiment_calls_not_made`` (the
  baseline's calls at the server minus the variant's).
- ``experiment_overhead``: the wall time of ``experiment run`` (scoring included) over
  the same trees started by hand: the baseline roots submitted, drained, then forked with
  the same agent swap, drained (goal <= 1.1).
- ``rescore_seconds``: one more scorer over the finished experiment (goal <= 2 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
import time
import uuid
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from bench.common import REPO_ROOT, report, scratch_database, worker_env
from runtime.config import load_settings
from runtime.experiments.datasets import Case, version_of
from runtime.experiments.runner import ExperimentPlan, ExperimentRunner, case_root
from runtime.experiments.scorers import DEFAULT_SCORERS, SCORERS
from runtime.experiments.variants import BASELINE, Variant
from runtime.forks.branch import plan_fork
from runtime.store.rows import TERMINAL_STATUSES
from runtime.wiring import Runtime, build_runtime
from tests.fake_ollama import FakeOllama, request_identity

MODULE = "docs.examples.experiments.scouts_v2"
SWAP = {"trend_analyst": "trend_analyst_v2"}
TOPICS = ("durable agent runtimes", "Postgres job queues", "LLM evaluation tools",
          "vector databases", "workflow engines", "observability for agents",
          "model gateways", "prompt registries", "GPU clouds", "feature stores",
          "data catalogs", "AI code review", "synthetic data", "speech APIs",
          "document parsing", "agent marketplaces", "edge inference", "guardrail services",
          "labeling platforms", "fine-tuning services")


def _cases(n: int) -> list[Case]:
    return [Case({"id": f"case{i}", "goal": f"Assess the market for {TOPICS[i % len(TOPICS)]}"
                  + (f" ({i // len(TOPICS) + 1})" if i >= len(TOPICS) else "")}, i)
            for i in range(n)]


def _runtime(url: str, model_url: str) -> Runtime:
    settings = load_settings(env={
        "ORGCHART_DATABASE_URL": url, "ORGCHART_LLM__BACKEND": "ollama",
        "ORGCHART_OLLAMA__URL": model_url, "ORGCHART_OLLAMA__MAX_PARALLEL": "64",
        "ORGCHART_OLLAMA__CLOUD_MAX_PARALLEL": "64",
        "ORGCHART_CONFIG": worker_env(url)["ORGCHART_CONFIG"]})
    return build_runtime(settings, [MODULE])


def _changed_calls(runtime: Runtime, roots: list[uuid.UUID]) -> tuple[int, int]:
    """(calls of the baseline trees, those the swap reaches) from ``model_calls``."""
    with runtime.store.engine.connect() as conn:
        total, changed = conn.execute(sa.text("""
            WITH RECURSIVE swapped AS (
                SELECT id, parent_id, true AS own FROM tasks
                WHERE root_id = ANY(:roots) AND to_agent = ANY(:agents)
                UNION
                SELECT t.id, t.parent_id, false FROM tasks t JOIN swapped s ON t.id = s.parent_id
            )
            SELECT count(*),
                   count(*) FILTER (WHERE EXISTS (
                       SELECT 1 FROM swapped s WHERE s.id = m.task_id
                         AND (s.own OR m.phase <> 'run')))
            FROM model_calls m WHERE m.root_id = ANY(:roots) AND NOT m.replayed
        """), {"roots": roots, "agents": list(SWAP)}).one()
    return int(total), int(changed)


def _by_hand(runtime: Runtime, cases: list[Case]) -> float:
    """The same trees without the runner: submit, drain, fork with the swap, drain."""
    store = runtime.store
    worker = runtime.worker(poll_interval_seconds=0.2, maintenance_interval_seconds=0.5)
    thread = threading.Thread(target=worker.run, daemon=True)
    started = time.perf_counter()
    thread.start()

    def wait(roots: list[uuid.UUID]) -> None:
        while any(store.reads.get(r)["status"] not in TERMINAL_STATUSES for r in roots):
            time.sleep(0.05)

    try:
        roots = [uuid.UUID(str(store.tasks.submit(case_root(runtime, c, "default"))[0]["id"]))
                 for c in cases]
        wait(roots)
        forks = []
        for root in roots:
            branch = plan_fork(store, runtime.registry, runtime.settings, root)
            forks.append(uuid.UUID(str(store.tasks.fork_root(
                dataclasses.replace(branch, agent_map=dict(SWAP)))["id"])))
        wait(forks)
        return time.perf_counter() - started
    finally:
        worker.stop("bench done")
        thread.join(timeout=60)


def main(cases: int = 20, delay: float = 0.05, server: str | None = None) -> dict[str, Any]:
    """Run the experiment and the same trees by hand; return the figures."""
    if str(REPO_ROOT) not in sys.path:  # the variant's agents module, by its import name
        sys.path.insert(0, str(REPO_ROOT))
    fake = FakeOllama().start()
    fake.delay_seconds = delay
    try:
        with scratch_database("experiments", server) as url:
            runtime = _runtime(url, fake.url)
            figures = _measure(runtime, fake, _cases(cases))
            runtime.store.dispose()
    finally:
        fake.stop()
    return report("experiments", figures)


def _measure(runtime: Runtime, fake: FakeOllama, cases: list[Case]) -> dict[str, Any]:
    store = runtime.store
    dataset_id, _ = store.experiments.dataset_put("bench", version_of(cases), "bench",
                                                  [c.body for c in cases])
    plan = ExperimentPlan(name="bench", dataset_id=dataset_id, cases=cases,
                          variants=[Variant(BASELINE), Variant("sharper_trends", dict(SWAP))],
                          scorers=[SCORERS[n] for n in DEFAULT_SCORERS if n != "tokens"],
                          timeout_seconds=1800)
    by_hand_before = _by_hand(runtime, cases)
    at: dict[str, int] = {"start": len(fake.requests)}
    started = time.perf_counter()
    summary = ExperimentRunner(runtime).run(
        plan, phase_done=lambda phase: at.__setitem__(phase, len(fake.requests)))
    experiment_seconds = time.perf_counter() - started
    baseline_calls = at["baselines"] - at["start"]
    variant_calls = at["variants"] - at["baselines"]
    runs = store.experiments.runs(summary.experiment_id)
    roots = [r["root_id"] for r in runs if r["variant"] == BASELINE]
    total, changed = _changed_calls(runtime, roots)
    replayed = sum(int(r["replayed_calls"]) for r in runs if r["variant"] != BASELINE)
    t0 = time.perf_counter()
    ExperimentRunner(runtime).score(summary.experiment_id, [SCORERS["tokens"]])
    rescore = time.perf_counter() - t0
    by_hand = (by_hand_before + _by_hand(runtime, cases)) / 2
    asked = [request_identity(body) for body in fake.requests]
    baseline_asked = set(asked[at["start"]:at["baselines"]])
    variant_asked = asked[at["baselines"]:at["variants"]]
    new_questions = sum(1 for a in variant_asked if a not in baseline_asked)
    return {
        "experiment_cases": len(cases),
        "experiment_baseline_calls_at_server": baseline_calls,
        "experiment_variant_calls_at_server": variant_calls,
        "experiment_paid_fraction": round(variant_calls / baseline_calls, 4),
        "experiment_changed_fraction": round(new_questions / baseline_calls, 4),
        "experiment_asked_again": variant_calls - new_questions,
        "experiment_reachable_fraction": round(changed / total, 4) if total else None,
        "experiment_replayed_calls": replayed,
        "experiment_calls_not_made": baseline_calls - variant_calls,
        "experiment_cost_replayed_usd": float(sum(
            (Decimal(r["replayed_cost_usd"]) for r in runs), Decimal(0))),
        "experiment_seconds": round(experiment_seconds, 2),
        "experiment_by_hand_seconds": round(by_hand, 2),  # the mean of one before, one after
        "experiment_overhead": round(experiment_seconds / by_hand, 3),
        "rescore_seconds": round(rescore, 3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--delay", type=float, default=0.05)
    args = parser.parse_args()
    main(args.cases, args.delay)
