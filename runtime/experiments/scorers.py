"""Scorers: one number (and a reason) per tree of an experiment, from what the tree holds.

A scorer reads a finished run (:class:`RunOutcome`: the case, the root's status, result,
verdict, times and spend) and returns a :class:`Score`, or None when it has nothing to
say about that case (the ``expected`` scorer on a case without ``expected``). It never
calls a model or runs a tree, so ``orgchart experiment rescore`` adds its rows to a
finished experiment in a moment.

Built in (:data:`SCORERS`):

- ``done``: 1 when the root ended ``done``, else 0;
- ``verdict``: the judge's verdict on the root: its ``score`` (0 when it did not pass);
- ``expected``: 1 when the root's result equals the case's ``expected`` or contains it
  (a JSON subset: every key of an object, recursively; every item of a list found in
  the answer's list), else 0;
- ``cost_usd``: what the tree's calls cost, replayed ones valued at their price (the
  cost of the answer standing alone; lower is better);
- ``latency_s``: the root's wall time from its creation to its end, plus what its calls
  replayed from the baseline took when the baseline made them, along the tree's slowest
  path (a task's own, then its slowest child: siblings run side by side), so a variant
  is not faster for having been replayed (lower is better);
- ``tokens``: the tokens of the tree's calls, replayed ones included (lower is better).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from runtime.errors import BadInput


@dataclass(frozen=True)
class Score:
    """A scorer's value for one run, with a one-line explanation."""

    value: float
    explanation: str


@dataclass(frozen=True)
class RunOutcome:
    """What a scorer may read of one run: its case and its root (``experiment_run_list``)."""

    case: dict[str, Any]
    variant: str
    repetition: int
    root: dict[str, Any]
    #: The calls replayed from the record, valued at their price.
    replayed_cost_usd: Decimal = Decimal(0)
    replayed_tokens: int = 0
    #: What the calls replayed from the baseline took when made (:func:`replayed_path`).
    replayed_seconds: float = 0.0

    @property
    def wall_seconds(self) -> float | None:
        """Seconds from the root's creation to its end, or None while it runs."""
        start, end = self.root.get("created_at"), self.root.get("completed_at")
        if not isinstance(start, dt.datetime) or not isinstance(end, dt.datetime):
            return None
        return (end - start).total_seconds()

    @property
    def latency_seconds(self) -> float | None:
        """The wall time, with each replayed call counted at its recorded duration."""
        wall = self.wall_seconds
        return None if wall is None else wall + self.replayed_seconds


def replayed_path(tasks: list[dict[str, Any]]) -> dict[Any, float]:
    """Per root, the replayed seconds along its slowest path from the root down.

    Args:
        tasks: rows of ``experiment_task_replayed_seconds`` (``root_id``, ``id``,
            ``parent_id``, ``replayed_seconds``), every task of each tree.

    Returns:
        For each root id: its own replayed seconds plus its slowest child's, recursively.
        A task's calls run one after another, its children side by side.

    """
    children: dict[Any, list[Any]] = {}
    own: dict[Any, float] = {}
    for row in tasks:
        own[row["id"]] = float(row["replayed_seconds"] or 0)
        if row["parent_id"] is not None:
            children.setdefault(row["parent_id"], []).append(row["id"])
    total: dict[Any, float] = {}
    for row in tasks:  # iterative post-order: a deep tree needs no deep recursion
        if row["parent_id"] is not None:
            continue
        stack = [(row["id"], False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                below = [total[c] for c in children.get(node, [])]
                total[node] = own[node] + max(below, default=0.0)
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in children.get(node, []))
    return {row["root_id"]: total[row["id"]] for row in tasks if row["parent_id"] is None}


@dataclass(frozen=True)
class Scorer:
    """A named scoring function and the direction in which its values are better."""

    name: str
    fn: Callable[[RunOutcome], Score | None]
    higher_is_better: bool = True
    description: str = ""

    def __call__(self, run: RunOutcome) -> Score | None:
        """Score one run (None: nothing to say about it)."""
        return self.fn(run)


def contains(answer: Any, expected: Any) -> bool:
    """True when ``expected`` is ``answer`` or a JSON subset of it."""
    if isinstance(expected, dict):
        return isinstance(answer, dict) and all(
            k in answer and contains(answer[k], v) for k, v in expected.items())
    if isinstance(expected, list):
        return isinstance(answer, list) and all(
            any(contains(a, e) for a in answer) for e in expected)
    if isinstance(expected, str) and isinstance(answer, str):
        return expected.strip().lower() == answer.strip().lower()
    return bool(answer == expected)


def _done(run: RunOutcome) -> Score:
    status = run.root.get("status")
    return Score(1.0 if status == "done" else 0.0, f"the root ended {status}")


def _verdict(run: RunOutcome) -> Score | None:
    verdict = run.root.get("verdict")
    if not isinstance(verdict, dict):
        return Score(0.0, f"no verdict (the root ended {run.root.get('status')})")
    score = float(verdict.get("score") or 0.0) if verdict.get("passed") else 0.0
    reasons = "; ".join(str(r) for r in (verdict.get("reasons") or [])[:2])
    return Score(score, f"{'passed' if verdict.get('passed') else 'not passed'}: {reasons}")


def _expected(run: RunOutcome) -> Score | None:
    if "expected" not in run.case:
        return None
    answer = run.root.get("result")
    if answer == run.case["expected"]:
        return Score(1.0, "the answer equals the expected one")
    if contains(answer, run.case["expected"]):
        return Score(1.0, "the answer contains the expected one")
    return Score(0.0, "the answer does not contain the expected one")


def _cost(run: RunOutcome) -> Score:
    paid = Decimal(run.root.get("cost_usd") or 0)
    total = paid + run.replayed_cost_usd
    return Score(float(total), f"${paid:.5f} paid, ${run.replayed_cost_usd:.5f} replayed")


def _latency(run: RunOutcome) -> Score | None:
    seconds, wall = run.latency_seconds, run.wall_seconds
    if seconds is None or wall is None:
        return None
    if not run.replayed_seconds:
        return Score(seconds, f"{seconds:.2f} s from submit to end")
    return Score(seconds, f"{seconds:.2f} s: {wall:.2f} s from submit to end, "
                          f"{run.replayed_seconds:.2f} s of replayed calls as recorded")


def _tokens(run: RunOutcome) -> Score:
    paid = int(run.root.get("tokens") or 0)
    return Score(float(paid + run.replayed_tokens),
                 f"{paid} paid, {run.replayed_tokens} replayed")


#: The built-in scorers, by name.
SCORERS: dict[str, Scorer] = {s.name: s for s in (
    Scorer("done", _done, True, "1 when the root ended done"),
    Scorer("verdict", _verdict, True, "the judge's score on the root (0 when not passed)"),
    Scorer("expected", _expected, True, "1 when the answer equals or contains 'expected'"),
    Scorer("cost_usd", _cost, False, "what the tree's calls cost, replayed ones valued"),
    Scorer("latency_s", _latency, False, "seconds from submit to the root's end, "
                                         "replayed calls at their recorded duration"),
    Scorer("tokens", _tokens, False, "tokens of the tree's calls, replayed ones included"),
)}
#: What ``experiment run`` scores unless told otherwise.
DEFAULT_SCORERS = ("done", "verdict", "expected", "cost_usd", "latency_s", "tokens")


def scorer(name: str) -> Scorer:
    """The scorer called ``name``; an unknown name is bad input naming the known ones."""
    try:
        return SCORERS[name]
    except KeyError:
        raise BadInput(f"unknown scorer {name!r} (known: {', '.join(SCORERS)})") from None
