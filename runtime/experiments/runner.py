"""Running an experiment: every case under every variant, baseline first, forks after.

:class:`ExperimentRunner` takes a checked :class:`ExperimentPlan` and:

1. creates the experiment (or, when one of that name exists with the same dataset and
   variants, resumes it: a killed ``experiment run`` run again finds every tree it had
   started, each recorded with its root in one transaction, and starts only the rest);
2. starts each case's **baseline** tree (``--repeat N``: N distinct trees, which never
   replay each other, so the variance is real) and drains them with a worker in this
   process, as ``orgchart run`` does;
3. starts every other variant of a case as a **fork** of that case's baseline tree (same
   repetition), with the variant's agent swaps (``tasks.agent_map``) and model: every call
   that asks what the baseline asked at the same place is replayed at zero cost;
4. scores every tree (:mod:`runtime.experiments.scorers`) and writes the score rows.

The experiment's trees share ``budget_usd``: once their calls have paid that much, no new
tree starts and the open ones are cancelled; the experiment ends ``stopped`` with a note
the report shows. A tree that ends ``failed`` or ``escalated`` is scored like any other.

Failure modes: a bad dataset, variant or scorer is :class:`~runtime.errors.BadInput`
before anything is written; a name taken by an experiment of another dataset or variants
is bad input too; the worker stopping (a signal) ends the run early, and the trees it
left resume on the next ``experiment run`` with the same name.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from runtime.errors import BadInput
from runtime.experiments.datasets import Case
from runtime.experiments.judges import TreeScorer
from runtime.experiments.report import run_outcomes
from runtime.experiments.scorers import RunOutcome, Score, Scorer
from runtime.experiments.variants import Variant
from runtime.forks.branch import plan_fork
from runtime.wiring import Runtime, build_root

log = logging.getLogger(__name__)

#: How long a rescore waits for its judge trees.
JUDGE_TIMEOUT_SECONDS = 1800.0
#: How often the runner looks at its trees while they run (one indexed read).
POLL_SECONDS = 0.05


@dataclass(frozen=True)
class ExperimentPlan:
    """A checked experiment: its dataset (stored), variants, repetitions and limits."""

    name: str
    dataset_id: uuid.UUID
    cases: list[Case]
    variants: list[Variant]
    scorers: list[Scorer | TreeScorer]
    repeat: int = 1
    budget_usd: Decimal | None = None
    tenant: str = "default"
    agents_modules: list[str] = field(default_factory=list)
    timeout_seconds: float = 3600.0


@dataclass
class RunSummary:
    """What one ``experiment run`` did: trees started here and found from before."""

    experiment_id: uuid.UUID
    started: int = 0
    resumed: int = 0
    stopped: str | None = None


def case_root(runtime: Runtime, case: Case, tenant: str) -> Any:
    """The root task of a case's baseline tree (checked like a submit)."""
    body = case.body
    return build_root(runtime.registry, runtime.settings, goal=body.get("goal"),
                      agent=body.get("agent", "ceo"), type_=body.get("type"),
                      payload=body.get("payload"), success=body.get("success_criteria"),
                      kill=body.get("kill_criteria"), tenant=tenant)


class ExperimentRunner:
    """Runs one experiment's trees in this process and scores them."""

    def __init__(self, runtime: Runtime, say: Callable[[str], None] = log.info) -> None:
        self.runtime = runtime
        self.store = runtime.store
        self.say = say
        self._worker: Any = None
        self._thread: threading.Thread | None = None

    def stop(self, reason: str = "stopped", now: bool = False) -> None:
        """Stop the worker draining the trees (a signal): the run ends, resumable."""
        if self._worker is not None:
            self._worker.stop(reason, now=now)

    # ---------------------------------------------------------------- the experiment
    def open(self, plan: ExperimentPlan) -> dict[str, Any]:
        """Create the experiment, or find the one of that name to resume."""
        variants = [v.as_json() for v in plan.variants]
        created = self.store.experiments.create(plan.name, plan.dataset_id, variants,
                                                plan.repeat, plan.budget_usd, plan.tenant,
                                                plan.agents_modules)
        if created is not None:
            return created
        existing = self.store.experiments.get(plan.name)
        assert existing is not None
        if (existing["dataset_id"] != plan.dataset_id or existing["variants"] != variants
                or existing["repeat"] != plan.repeat):
            raise BadInput(f"experiment {plan.name!r} exists with another dataset, variants or "
                           "--repeat; resume it with the same ones or pick another --name")
        if existing["status"] != "running":
            self.store.experiments.set_status(existing["id"], "running")
        self.say(f"resuming experiment {plan.name!r}")
        return existing

    def run(self, plan: ExperimentPlan, *, submit_only: bool = False,
            phase_done: Callable[[str], None] | None = None) -> RunSummary:
        """Start (or resume) every tree, drain them here unless ``submit_only``, score.

        ``phase_done`` hears ``"baselines"`` once the baseline trees have ended (before a
        fork starts) and ``"variants"`` once the forks have (the bench counts the model
        server's calls between the two).
        """
        experiment = self.open(plan)
        summary = RunSummary(experiment["id"])
        deadline = time.monotonic() + plan.timeout_seconds
        if not submit_only:
            self._start_worker()
        try:
            baselines = self._start_baselines(plan, summary)
            if not submit_only:
                self._wait(summary, list(baselines.values()), deadline, plan.budget_usd)
                if phase_done is not None:
                    phase_done("baselines")
            forks = [] if summary.stopped else self._start_forks(plan, summary, baselines)
            if not submit_only and not summary.stopped:
                self._wait(summary, forks, deadline, plan.budget_usd)
                if phase_done is not None:
                    phase_done("variants")
            if not submit_only:  # judge trees only while the budget and the time last
                self.score(experiment["id"], plan.scorers, tenant=plan.tenant,
                           summary=None if summary.stopped else summary,
                           deadline=deadline, budget=plan.budget_usd)
        finally:
            self._stop_worker()
        if submit_only:
            return summary
        if summary.stopped:
            self.store.experiments.set_status(experiment["id"], "stopped", summary.stopped)
        else:
            self.store.experiments.set_status(experiment["id"], "finished")
        return summary

    # ---------------------------------------------------------------- starting trees
    def _budget_left(self, budget: Decimal | None, summary: RunSummary) -> bool:
        if summary.stopped:
            return False
        if budget is None:
            return True
        spent = self.store.experiments.spend(summary.experiment_id)
        if spent >= budget:
            summary.stopped = (f"budget reached: ${spent:.5f} spent of "
                               f"${budget:.5f}; no new tree started")
            return False
        return True

    def _start_baselines(self, plan: ExperimentPlan,
                         summary: RunSummary) -> dict[tuple[int, int], uuid.UUID]:
        roots: dict[tuple[int, int], uuid.UUID] = {}
        for repetition in range(plan.repeat):
            for case in plan.cases:
                key = (case.position, repetition)
                known = self.store.experiments.run_root(summary.experiment_id, case.position,
                                                        "baseline", repetition)
                if known is not None:
                    roots[key], summary.resumed = known, summary.resumed + 1
                    continue
                if not self._budget_left(plan.budget_usd, summary):
                    return roots
                root, started = self.store.experiments.start(
                    summary.experiment_id, case.position, "baseline", repetition,
                    new=case_root(self.runtime, case, plan.tenant))
                roots[key] = root
                summary.started += started
                summary.resumed += not started
        return roots

    def _start_forks(self, plan: ExperimentPlan, summary: RunSummary,
                     baselines: dict[tuple[int, int], uuid.UUID]) -> list[uuid.UUID]:
        roots: list[uuid.UUID] = []
        for variant in plan.variants:
            if variant.is_baseline:
                continue
            for (position, repetition), baseline in sorted(baselines.items()):
                known = self.store.experiments.run_root(summary.experiment_id, position,
                                                        variant.name, repetition)
                if known is not None:
                    roots.append(known)
                    summary.resumed += 1
                    continue
                if not self._budget_left(plan.budget_usd, summary):
                    return roots
                root, started = self.store.experiments.start(
                    summary.experiment_id, position, variant.name, repetition,
                    branch=self._branch(plan, variant, baseline))
                roots.append(root)
                summary.started += started
                summary.resumed += not started
        return roots

    def _branch(self, plan: ExperimentPlan, variant: Variant, baseline: uuid.UUID) -> Any:
        branch = plan_fork(self.store, self.runtime.registry, self.runtime.settings, baseline,
                           model=variant.model,
                           note=f"experiment {plan.name}, variant {variant.name}")
        return dataclasses.replace(
            branch, agent_map=dict(variant.agents) or None,
            to_agent=variant.agents.get(branch.to_agent, branch.to_agent))

    # ---------------------------------------------------------------- draining
    def _start_worker(self) -> None:
        self._worker = self.runtime.worker(poll_interval_seconds=0.2,
                                           maintenance_interval_seconds=0.5)
        self._thread = threading.Thread(target=self._worker.run, name="experiment-worker",
                                        daemon=True)
        self._thread.start()

    def _stop_worker(self) -> None:
        if self._worker is not None and self._thread is not None:
            self._worker.stop("experiment finished")
            self._thread.join(timeout=60)
        self._worker = self._thread = None

    def _wait(self, summary: RunSummary, roots: Sequence[uuid.UUID], deadline: float,
              budget: Decimal | None = None) -> None:
        """Until every tree of ``roots`` ended (or the budget or the time ran out)."""
        wanted = set(roots)
        while wanted:
            open_roots = sorted(self.store.experiments.open_roots(summary.experiment_id)
                                & wanted)
            if not open_roots:
                return
            if budget is not None and not self._budget_left(budget, summary):
                for root in open_roots:
                    self.store.steering.cancel(root, actor="experiment", note=summary.stopped)
                summary.stopped = (summary.stopped or "") + (
                    f"; {len(open_roots)} running tree(s) cancelled")
                return
            if self._thread is not None and not self._thread.is_alive():
                summary.stopped = (f"the worker stopped with {len(open_roots)} tree(s) open;"
                                   " run the experiment again to resume it")
                return
            if time.monotonic() > deadline:
                summary.stopped = (f"timed out with {len(open_roots)} tree(s) still open; "
                                   "run the experiment again to resume it")
                return
            time.sleep(POLL_SECONDS)

    # ---------------------------------------------------------------- scoring
    def outcomes(self, experiment_id: uuid.UUID) -> list[RunOutcome]:
        """Every finished tree of the experiment as the scorers read it."""
        return run_outcomes(self.store, experiment_id)

    def score(self, experiment_id: uuid.UUID, scorers: Sequence[Scorer | TreeScorer], *,
              tenant: str = "default", summary: RunSummary | None = None,
              deadline: float | None = None, budget: Decimal | None = None) -> int:
        """Score every finished tree with ``scorers``; write the rows; return how many.

        Judge scorers (:mod:`runtime.experiments.judges`) start their judge trees and wait
        for them, with this runner's worker (one is started when none runs). Without a
        ``summary`` (an experiment stopped by its budget) they are left out.
        """
        outcomes = self.outcomes(experiment_id)
        rows = [_row(run, s.name, s(run)) for run in outcomes
                for s in scorers if isinstance(s, Scorer)]
        judges = [s for s in scorers if isinstance(s, TreeScorer)]
        if judges and (summary is not None or deadline is None):
            rows += self._judged(experiment_id, outcomes, judges, tenant,
                                 summary or RunSummary(experiment_id),
                                 deadline or time.monotonic() + JUDGE_TIMEOUT_SECONDS, budget)
        self.store.experiments.put_scores(experiment_id, rows)
        return len(rows)

    def _judged(self, experiment_id: uuid.UUID, outcomes: Sequence[RunOutcome],
                judges: Sequence[TreeScorer], tenant: str, summary: RunSummary,
                deadline: float, budget: Decimal | None) -> list[dict[str, Any]]:
        """Start the judge trees (each once), wait for them, read their scores."""
        started_worker = self._worker is None
        if started_worker:
            self._start_worker()
        try:
            requests = [(j, r) for j in judges
                        for r in j.requests(experiment_id, outcomes, tenant)]
            roots = []
            for _, r in requests:
                if not self._budget_left(budget, summary):
                    break
                root, _ = self.store.experiments.start(
                    experiment_id, r.outcome.root["position"], r.run_variant,
                    r.outcome.repetition, new=r.task)
                roots.append(root)
            self._wait(summary, roots, deadline, budget)
        finally:
            if started_worker:
                self._stop_worker()
        rows = []
        for (judge, request), root in zip(requests, roots, strict=False):
            rows.append(_row(request.outcome, judge.name,
                             judge.score(request, self.store.reads.get(root))))
        return rows


def _row(run: RunOutcome, scorer: str, result: Score | None) -> dict[str, Any]:
    return {"position": run.root["position"], "variant": run.variant,
            "repetition": run.repetition, "scorer": scorer,
            "value": None if result is None else result.value,
            "explanation": None if result is None else result.explanation}
