"""An experiment's report: scores with intervals, cost paid and replayed, regressions.

Per variant: its scores with intervals, its cost paid and replayed, and how it differs
from the baseline, case by case.

:func:`build_report` reads the experiment's runs and score rows and returns the JSON that
``orgchart experiment show --json`` prints and the page draws:

``{"id", "name", "status", "note", "dataset", "repeat", "scorers", "variants": [...],
"cases": [...]}``, each variant ``{"name", "trees", "open", "failed", "cancelled",
"paid_calls", "replayed_calls", "cost_paid_usd", "cost_replayed_usd", "tokens",
"latency_p50", "latency_p90", "pass_rate", "scores": {SCORER: {"mean", "ci_low",
"ci_high", "n"}}, "vs_baseline": {SCORER: {"diff", "ci_low", "ci_high", "p_value", "n",
"direction"}}}``; each entry of ``cases`` a regression or an improvement of one variant on
one case and scorer beyond :func:`is_same`, with the two trees to diff.

Repetitions of a case are averaged before cases are paired, so a case counts once
however often it ran. Intervals: :mod:`runtime.experiments.stats`.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from runtime.experiments.scorers import SCORERS, RunOutcome, replayed_path
from runtime.experiments.stats import bootstrap_ci, paired_difference
from runtime.store.rows import TERMINAL_STATUSES, NotFound
from runtime.store.store import Store

#: A difference is called better or worse only when its interval excludes zero and the
#: paired test's p-value is at most this (with three cases, no p-value is below 0.25).
SIGNIFICANCE = 0.05
#: A difference within this share of the baseline's value is the same (a tree of 4,460
#: tokens against one of 4,461 did not regress). One rule for the table's ``same`` and
#: for the cases listed as regressions or improvements (:func:`is_same`).
SAME_WITHIN = 0.01


def is_same(diff: float, baseline: float) -> bool:
    """Whether a difference from ``baseline`` is too small to call better or worse.

    Zero, or within :data:`SAME_WITHIN` of the baseline's magnitude: a 0/1 scorer (``done``)
    still changes by its whole value, a token count does not by one token.
    """
    return abs(diff) <= SAME_WITHIN * abs(baseline)


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _higher_is_better(scorer: str) -> bool:
    known = SCORERS.get(scorer)
    return True if known is None else known.higher_is_better


def _per_case(scores: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[int, float]]:
    """``{(scorer, variant): {case position: mean over repetitions}}``."""
    sums: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for s in scores:
        if s["value"] is not None:
            sums[(s["scorer"], s["variant"], s["position"])].append(float(s["value"]))
    out: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for (scorer, variant, position), values in sums.items():
        out[(scorer, variant)][position] = sum(values) / len(values)
    return out


def _variant_row(name: str, runs: Sequence[dict[str, Any]],
                 outcomes: dict[uuid.UUID, RunOutcome]) -> dict[str, Any]:
    mine = [r for r in runs if r["variant"] == name]
    latencies = [o.latency_seconds for r in mine
                 if (o := outcomes.get(r["root_id"])) and o.latency_seconds is not None]
    verdicts = [r["verdict"] for r in mine if r["status"] in ("done", "failed", "escalated")]
    passed = sum(1 for v in verdicts if isinstance(v, dict) and v.get("passed"))
    replayed_cost = sum((o.replayed_cost_usd for r in mine
                         if (o := outcomes.get(r["root_id"]))), Decimal(0))
    return {
        "name": name, "trees": len(mine),
        "open": sum(1 for r in mine if r["status"] not in
                    ("done", "failed", "escalated", "cancelled")),
        "failed": sum(1 for r in mine if r["status"] in ("failed", "escalated")),
        "cancelled": sum(1 for r in mine if r["status"] == "cancelled"),
        "paid_calls": sum(int(r["paid_calls"]) for r in mine),
        "replayed_calls": sum(int(r["replayed_calls"]) for r in mine),
        "cost_paid_usd": float(sum((Decimal(r["cost_usd"]) for r in mine), Decimal(0))),
        "cost_replayed_usd": float(replayed_cost),
        "tokens": sum(int(r["tokens"]) for r in mine),
        "latency_p50": _quantile(latencies, 0.5), "latency_p90": _quantile(latencies, 0.9),
        "pass_rate": passed / len(verdicts) if verdicts else None,
    }


def _against_baseline(name: str, scorer: str,
                      by_case: dict[tuple[str, str], dict[int, float]]) -> dict[str, Any] | None:
    base, mine = by_case.get((scorer, "baseline"), {}), by_case.get((scorer, name), {})
    shared = sorted(set(base) & set(mine))
    if not shared:
        return None
    paired = paired_difference([base[p] for p in shared], [mine[p] for p in shared])
    d = paired.diff
    better = _higher_is_better(scorer)
    direction = "same"
    significant = paired.p_value is None or paired.p_value <= SIGNIFICANCE
    base_mean = sum(base[p] for p in shared) / len(shared)
    if (paired.excludes_zero and significant and d.mean is not None
            and not is_same(d.mean, base_mean)):
        direction = "better" if (d.mean > 0) == better else "worse"
    return {"diff": d.mean, "ci_low": d.low, "ci_high": d.high, "p_value": paired.p_value,
            "n": d.n, "direction": direction, "higher_is_better": better}


def _case_changes(variants: Sequence[str], scorers: Sequence[str], runs: Sequence[dict[str, Any]],
                  by_case: dict[tuple[str, str], dict[int, float]],
                  names: dict[int, str]) -> list[dict[str, Any]]:
    roots = {(r["variant"], r["position"]): r["root_id"] for r in runs if r["repetition"] == 0}
    changes = []
    for name in variants:
        for scorer in scorers:
            base, mine = by_case.get((scorer, "baseline"), {}), by_case.get((scorer, name), {})
            for position in sorted(set(base) & set(mine)):
                diff = mine[position] - base[position]
                if is_same(diff, base[position]):
                    continue
                better = (diff > 0) == _higher_is_better(scorer)
                a, b = roots.get(("baseline", position)), roots.get((name, position))
                changes.append({
                    "variant": name, "case": position, "case_name": names.get(position),
                    "scorer": scorer, "baseline": base[position], "value": mine[position],
                    "diff": diff, "kind": "improvement" if better else "regression",
                    "baseline_root": str(a) if a else None, "root": str(b) if b else None,
                    "diff_command": f"orgchart diff {a} {b}" if a and b else None})
    return changes


def build_report(experiment: dict[str, Any], runs: Sequence[dict[str, Any]],
                 scores: Sequence[dict[str, Any]], outcomes: Sequence[RunOutcome],
                 cases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The report of one experiment (see the module's docstring for its shape)."""
    by_root = {o.root["root_id"]: o for o in outcomes}
    variants = [v["name"] for v in experiment["variants"]]
    scorer_names = sorted({s["scorer"] for s in scores})
    by_case = _per_case(scores)
    rows = []
    for name in variants:
        row = _variant_row(name, runs, by_root)
        row["scores"] = {}
        for scorer in scorer_names:
            values = list(by_case.get((scorer, name), {}).values())
            ci = bootstrap_ci(values)
            row["scores"][scorer] = {"mean": ci.mean, "ci_low": ci.low, "ci_high": ci.high,
                                     "n": ci.n}
        row["vs_baseline"] = {} if name == "baseline" else {
            scorer: cmp for scorer in scorer_names
            if (cmp := _against_baseline(name, scorer, by_case)) is not None}
        rows.append(row)
    names = {i: str(c.get("id") or c.get("goal") or f"case {i}")[:80] for i, c in enumerate(cases)}
    others = [v for v in variants if v != "baseline"]
    return {
        "id": str(experiment["id"]), "name": experiment["name"],
        "status": experiment["status"], "note": experiment.get("note"),
        "dataset": {"name": experiment.get("dataset_name"),
                    "version": experiment.get("dataset_version"), "cases": len(cases)},
        "repeat": experiment["repeat"],
        "budget_usd": (None if experiment.get("budget_usd") is None
                       else float(experiment["budget_usd"])),
        "scorers": scorer_names, "variants": rows,
        "cases": _case_changes(others, scorer_names, runs, by_case, names),
    }


def run_outcomes(store: Store, experiment_id: uuid.UUID) -> list[RunOutcome]:
    """Every finished tree of an experiment as the scorers read it."""
    experiment = store.experiments.get(str(experiment_id))
    if experiment is None:
        raise NotFound(f"no experiment {experiment_id}")
    cases = store.experiments.dataset_cases(experiment["dataset_id"])
    variants = {v["name"] for v in experiment["variants"]}  # not the judges' trees
    # A replayed call took no time here; it counts what it took when made (latency_s).
    replayed = replayed_path(store.experiments.task_replayed_seconds(experiment_id))
    return [RunOutcome(cases[row["position"]], row["variant"], row["repetition"], row,
                       Decimal(row["replayed_cost_usd"]), int(row["replayed_tokens"]),
                       replayed.get(row["root_id"], 0.0))
            for row in store.experiments.runs(experiment_id)
            if row["status"] in TERMINAL_STATUSES and row["variant"] in variants]


def load_report(store: Store, key: str) -> dict[str, Any]:
    """The report of the experiment named (or numbered) ``key``, read from the store.

    Raises:
        NotFound: no such experiment.

    """
    experiment = store.experiments.get(key)
    if experiment is None:
        raise NotFound(f"no experiment {key!r}")
    return build_report(experiment, store.experiments.runs(experiment["id"]),
                        store.experiments.scores(experiment["id"]),
                        run_outcomes(store, experiment["id"]),
                        store.experiments.dataset_cases(experiment["dataset_id"]))


def worse_than_baseline(report: dict[str, Any], scorer: str,
                        margin: float = 0.0) -> list[dict[str, Any]]:
    """The variants worse than the baseline on ``scorer`` (``--fail-if-worse``).

    Worse: the difference goes the wrong way by more than ``margin`` and its interval
    excludes zero. Each comes with its regressed cases.
    """
    worse = []
    for row in report["variants"]:
        cmp = row["vs_baseline"].get(scorer)
        if cmp is None or cmp["diff"] is None or cmp["direction"] != "worse":
            continue
        if abs(cmp["diff"]) <= margin:
            continue
        cases = [c for c in report["cases"] if c["variant"] == row["name"]
                 and c["scorer"] == scorer and c["kind"] == "regression"]
        worse.append({"variant": row["name"], **cmp, "regressions": cases})
    return worse
