"""Scorers that ask a model: a rubric judge, and a pairwise judge against the baseline.

A model judge is work like any other, so it runs as trees in the same table: each score
is one root task for the built-in ``judge`` agent (a rubric) or ``pairwise_judge`` agent
(two answers), recorded as an experiment run named ``SCORER:VARIANT`` in the transaction
that inserts it. The judges are durable, budgeted (they count in the experiment's
``--budget-usd``), replayed on a resume, never submitted twice, and visible with
``orgchart tree``.

- ``rubric``: the judge agent's score (0..1) of a tree's answer against the case's
  ``rubric`` (else the judge's default rubric); no row when the judge was uncertain
  (the offline backend always is: a hash of the prompt is not a judgement).
- ``pairwise``: for each variant tree, the baseline tree of the same case and repetition
  beside it, **in an order drawn at random** (seeded by the experiment, case, variant and
  repetition, so a resume draws the same) and recorded in the explanation; 1 when the
  variant's answer is preferred, 0 when the baseline's is, 0.5 for a tie.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.errors import BadInput
from runtime.experiments.scorers import SCORERS, RunOutcome, Score, Scorer
from runtime.store.rows import NewTask

#: The agents the judge scorers submit to.
RUBRIC_AGENT = "judge"
PAIRWISE_AGENT = "pairwise_judge"


@dataclass(frozen=True)
class JudgeRequest:
    """One judge tree to start: what it scores, the run it is recorded as, its root."""

    outcome: RunOutcome
    run_variant: str
    task: NewTask
    shown_first: str | None = None


@dataclass(frozen=True)
class TreeScorer:
    """A scorer whose values come from judge trees (:mod:`runtime.experiments.judges`)."""

    name: str
    agent: str
    higher_is_better: bool = True
    description: str = ""

    def requests(self, experiment_id: uuid.UUID, outcomes: Sequence[RunOutcome],
                 tenant: str) -> list[JudgeRequest]:
        """The judge trees this scorer needs for ``outcomes``."""
        if self.agent == PAIRWISE_AGENT:
            return _pairwise_requests(self, experiment_id, outcomes, tenant)
        return [JudgeRequest(o, f"{self.name}:{o.variant}", _task(
            RUBRIC_AGENT, {"result": o.root.get("result"), "rubric": _rubric(o),
                           "goal": _goal(o), "threshold": 0.7}, tenant))
                for o in outcomes]

    def score(self, request: JudgeRequest, judged: dict[str, Any]) -> Score | None:
        """The score a finished judge tree gives ``request`` (None when uncertain)."""
        result = judged.get("result") if judged.get("status") == "done" else None
        if not isinstance(result, dict):
            return None
        if result.get("uncertain"):
            return None
        reasons = "; ".join(str(r) for r in (result.get("reasons") or [])[:2])
        if self.agent == RUBRIC_AGENT:
            return Score(float(result.get("score") or 0.0), reasons)
        preferred = result.get("preferred")
        if preferred == "tie":
            value = 0.5
        else:
            value = 1.0 if (preferred == "first") == (request.shown_first == "variant") else 0.0
        return Score(value, f"{request.shown_first} shown first; {preferred} preferred: "
                            f"{reasons}")


def _goal(outcome: RunOutcome) -> str:
    case = outcome.case
    payload = case.get("payload") or {}
    return str(case.get("goal") or payload.get("goal") or "")


def _rubric(outcome: RunOutcome) -> str:
    from agents.judge import DEFAULT_RUBRIC

    criteria = outcome.case.get("success_criteria")
    rubric = criteria.get("rubric") if isinstance(criteria, dict) else None
    return str(outcome.case.get("rubric") or rubric or DEFAULT_RUBRIC)


def _task(agent: str, payload: dict[str, Any], tenant: str) -> NewTask:
    return NewTask(to_agent=agent, type="judge", payload=payload, tenant=tenant)


def shown_first(experiment_id: uuid.UUID, outcome: RunOutcome) -> str:
    """``variant`` or ``baseline``: drawn at random, the same draw on every resume."""
    seed = hashlib.sha256(f"{experiment_id}:{outcome.root['position']}:{outcome.variant}:"
                          f"{outcome.repetition}".encode()).digest()
    return random.Random(seed).choice(("variant", "baseline"))


def _pairwise_requests(scorer: TreeScorer, experiment_id: uuid.UUID,
                       outcomes: Sequence[RunOutcome], tenant: str) -> list[JudgeRequest]:
    baselines = {(o.root["position"], o.repetition): o for o in outcomes
                 if o.variant == "baseline"}
    requests = []
    for o in outcomes:
        base = baselines.get((o.root["position"], o.repetition))
        if o.variant == "baseline" or base is None:
            continue
        first = shown_first(experiment_id, o)
        answers = (o, base) if first == "variant" else (base, o)
        payload = {"goal": _goal(o), "rubric": _rubric(o),
                   "first": answers[0].root.get("result"),
                   "second": answers[1].root.get("result")}
        requests.append(JudgeRequest(o, f"{scorer.name}:{o.variant}",
                                     _task(PAIRWISE_AGENT, payload, tenant), first))
    return requests


#: The judge scorers, by name.
TREE_SCORERS: dict[str, TreeScorer] = {s.name: s for s in (
    TreeScorer("rubric", RUBRIC_AGENT, True,
               "the judge agent's score of the answer against the case's rubric"),
    TreeScorer("pairwise", PAIRWISE_AGENT, True,
               "1 when a model judge prefers the variant's answer to the baseline's "
               "(shown in random order), 0.5 for a tie"),
)}


def lookup(name: str) -> Scorer | TreeScorer:
    """A built-in or judge scorer by name; an unknown name is bad input naming them all."""
    if name in TREE_SCORERS:
        return TREE_SCORERS[name]
    if name in SCORERS:
        return SCORERS[name]
    known = [*SCORERS, *TREE_SCORERS]
    raise BadInput(f"unknown scorer {name!r} (known: {', '.join(known)})")
