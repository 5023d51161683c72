"""Datasets and experiments: ``orgchart dataset ...`` and ``orgchart experiment ...``.

``experiment run`` runs a dataset's cases under the variants of a TOML file (the baseline
first, every other variant a fork of it) in this process, scores the trees and prints the
report; ``--fail-if-worse SCORER[:MARGIN]`` exits 1 when a variant is worse than the
baseline beyond the margin with its interval excluding zero (for CI jobs). ``show`` prints
a report again, ``rescore`` adds a scorer's rows without running a tree. docs/experiments.md
walks through an example.
"""

from __future__ import annotations

import uuid
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from runtime.cli.common import (
    EXIT_FAILED,
    JsonOpt,
    ModulesOpt,
    TaskRef,
    err,
    fail,
    install_stop_signals,
    open_runtime,
    out,
    print_json,
    settings,
)
from runtime.errors import BadInput
from runtime.store.rows import NotFound


def _store() -> Any:
    from runtime.wiring import open_store

    return open_store(settings())


# --------------------------------------------------------------------------- datasets
def dataset_add(name: Annotated[str, typer.Argument(help="The dataset's name.")],
                file: Annotated[Path, typer.Argument(help="A JSONL file, one case a line.")],
                json_: JsonOpt = False) -> None:
    """Store a dataset (a new version when its cases changed)."""
    from runtime.experiments.datasets import read_cases, version_of

    cases = read_cases(file)
    version = version_of(cases)
    dataset_id, created = _store().experiments.dataset_put(name, version, str(file),
                                                           [c.body for c in cases])
    result = {"id": str(dataset_id), "name": name, "version": version, "cases": len(cases),
              "created": created}
    if json_:
        print_json(result)
    else:
        out.print(f"dataset {name} version {version}: {len(cases)} cases"
                  + ("" if created else " (already stored)"), highlight=False, markup=False)


def dataset_list(json_: JsonOpt = False) -> None:
    """List stored datasets and their versions."""
    rows = _store().experiments.datasets()
    if json_:
        print_json([{**r, "id": str(r["id"]), "created_at": r["created_at"].isoformat()}
                    for r in rows])
        return
    table = Table("name", "version", "cases", "source", "stored")
    for r in rows:
        table.add_row(escape(r["name"]), r["version"], str(r["cases"]),
                      escape(r["source"] or "-"),
                      r["created_at"].strftime("%Y-%m-%d %H:%M"))
    out.print(table)


def dataset_from_roots(name: Annotated[str, typer.Argument(help="The dataset's name.")],
                       roots: Annotated[list[str], typer.Argument(help="Finished roots.")],
                       json_: JsonOpt = False) -> None:
    """Make a dataset from finished trees: each root's goal, with its result as expected."""
    from runtime.experiments.datasets import Case, version_of

    store = _store()
    bodies = []
    for raw in roots:
        root = store.reads.get(TaskRef.parse(raw, "root id").resolve(store))
        if root["parent_id"] is not None:
            raise BadInput(f"{root['id']} is not a root (its root is {root['root_id']})")
        if root["status"] != "done":
            raise BadInput(f"root {root['id']} is {root['status']}: only trees that ended done "
                           "make cases")
        body: dict[str, Any] = {"agent": root["to_agent"], "payload": root["payload"],
                                "expected": root["result"]}
        if isinstance(root["payload"], dict) and isinstance(root["payload"].get("goal"), str):
            body["id"] = root["payload"]["goal"][:60]
        for key in ("success_criteria", "kill_criteria"):
            if root.get(key) is not None:
                body[key] = root[key]
        bodies.append(body)
    cases = [Case(b, i) for i, b in enumerate(bodies)]
    version = version_of(cases)
    dataset_id, created = store.experiments.dataset_put(name, version, "from roots", bodies)
    if json_:
        print_json({"id": str(dataset_id), "name": name, "version": version,
                    "cases": len(cases), "created": created})
    else:
        out.print(f"dataset {name} version {version}: {len(cases)} cases from finished trees",
                  highlight=False, markup=False)


# --------------------------------------------------------------------------- experiments
def _dataset(store: Any, key: str) -> tuple[uuid.UUID, list[Any]]:
    """A stored dataset's id and cases, storing a JSONL file named by path first."""
    from runtime.experiments.datasets import Case, read_cases, version_of

    path = Path(key)
    if path.suffix in (".jsonl", ".json") or path.exists():
        cases = read_cases(path)
        dataset_id, _ = store.experiments.dataset_put(path.stem, version_of(cases), str(path),
                                                      [c.body for c in cases])
        return dataset_id, cases
    row = store.experiments.dataset_get(key)
    if row is None:
        raise BadInput(f"no dataset {key!r} (orgchart dataset add {key} FILE.jsonl, or name "
                       "a .jsonl file)")
    return row["id"], [Case(b, i) for i, b in enumerate(store.experiments.dataset_cases(row["id"]))]


def _fail_rule(value: str | None) -> tuple[str, float] | None:
    if not value:
        return None
    name, _, margin = value.partition(":")
    from runtime.experiments.judges import lookup

    lookup(name)
    try:
        return name, float(margin) if margin else 0.0
    except ValueError:
        raise BadInput(f"--fail-if-worse {value!r}: the margin after ':' is a number") from None


def _budget(value: str | None) -> Decimal | None:
    if value is None:
        return None
    try:
        budget = Decimal(value)
    except InvalidOperation:
        raise BadInput(f"--budget-usd {value!r} is not a number") from None
    if not budget.is_finite() or budget <= 0:
        raise BadInput(f"--budget-usd must be a positive amount (got {value})")
    return budget


def _variants(path: Path | None, only: list[str] | None) -> list[Any]:
    """The variants of ``path`` (the baseline first), narrowed to ``--only``."""
    from runtime.experiments.variants import read_variants

    variants = read_variants(path)
    if only:
        unknown = sorted(set(only) - {v.name for v in variants})
        if unknown:
            raise BadInput(f"--only {unknown[0]!r}: no such variant in the variants file")
        variants = [v for v in variants if v.is_baseline or v.name in only]
    return variants


def experiment_run(
    dataset: Annotated[str, typer.Argument(help="A stored dataset's name or a JSONL file.")],
    variants: Annotated[Path | None, typer.Option(
        "--variants", help="A TOML file of [variants.NAME] tables.")] = None,
    only: Annotated[list[str] | None, typer.Option(
        "--only", help="Run only these variants (the baseline always runs).")] = None,
    name: Annotated[str | None, typer.Option(
        "--name", help="The experiment's name (run again to resume it).")] = None,
    repeat: Annotated[int, typer.Option("--repeat", min=1, max=100,
                                        help="Distinct trees per case and variant.")] = 1,
    budget_usd: Annotated[str | None, typer.Option(
        "--budget-usd", help="What all the experiment's trees may spend together.")] = None,
    tenant: Annotated[str, typer.Option("--tenant", help="The trees' tenant.")] = "default",
    scorer_names: Annotated[list[str] | None, typer.Option(
        "--scorer", help="Scorers to run (default: all that need no model; "
                         "'rubric' and 'pairwise' ask one).")] = None,
    fail_if_worse: Annotated[str | None, typer.Option(
        "--fail-if-worse", help="SCORER[:MARGIN]: exit 1 when a variant is worse.")] = None,
    submit_only: Annotated[bool, typer.Option(
        "--submit-only", help="Start the trees and return; workers run them.")] = False,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 3600,
    agents_module: ModulesOpt = None, json_: JsonOpt = False,
) -> None:
    """Run a dataset under variants (baseline first, the others forks of it); print the report."""
    from runtime.experiments.judges import lookup
    from runtime.experiments.runner import ExperimentPlan, ExperimentRunner
    from runtime.experiments.scorers import DEFAULT_SCORERS
    from runtime.experiments.variants import check_variants

    rule = _fail_rule(fail_if_worse)
    chosen = [lookup(n) for n in (scorer_names or DEFAULT_SCORERS)]
    budget = _budget(budget_usd)
    plan_variants = _variants(variants, only)
    runtime = open_runtime(agents_module)
    check_variants(plan_variants, runtime.registry, runtime.settings)
    dataset_id, cases = _dataset(runtime.store, dataset)
    for case in cases:  # every case's root is checked before anything runs
        from runtime.experiments.runner import case_root

        case_root(runtime, case, tenant)
    plan = ExperimentPlan(
        name=name or f"exp-{uuid.uuid4().hex[:8]}", dataset_id=dataset_id, cases=cases,
        variants=plan_variants, scorers=chosen, repeat=repeat, budget_usd=budget,
        tenant=tenant, agents_modules=list(agents_module or []), timeout_seconds=timeout)
    runner = ExperimentRunner(runtime, say=lambda m: err.print(m, style="dim", markup=False))
    err.print(f"experiment {plan.name}: {len(cases)} cases x {len(plan_variants)} variants"
              f" x {repeat}", style="dim", markup=False, highlight=False)
    install_stop_signals(runner.stop)
    summary = runner.run(plan, submit_only=submit_only)
    err.print(f"{summary.started} tree(s) started, {summary.resumed} found from before"
              + (f"; {summary.stopped}" if summary.stopped else ""),
              style="dim", markup=False, highlight=False)
    if submit_only:
        if json_:
            print_json({"id": str(summary.experiment_id), "name": plan.name,
                        "started": summary.started, "resumed": summary.resumed})
        return
    _show(runtime, plan.name, json_, rule)


def _report(runtime: Any, key: str) -> dict[str, Any]:
    from runtime.experiments.report import load_report

    return load_report(runtime.store, key)


def figure(value: float | None, digits: int = 3, sign: bool = False) -> str:
    """A figure for a report, never in exponent notation; ``-`` for None.

    Integers print as integers (4,460, not 4.46e+03), as does any figure of 10**digits or
    more; others with ``digits`` significant digits.
    """
    if value is None:
        return "-"
    plus = "+" if sign else ""
    if float(value).is_integer() or abs(value) >= 10 ** digits:
        return f"{value:{plus},.0f}"
    return f"{value:{plus}.{digits}g}"



def _score_cell(row: dict[str, Any], scorer: str) -> str:
    s = row["scores"].get(scorer, {})
    cell = f"{figure(s.get('mean'))} [{figure(s.get('ci_low'))}, {figure(s.get('ci_high'))}]"
    cmp = row["vs_baseline"].get(scorer)
    if cmp and cmp["diff"] is not None:
        cell += (f"\n{figure(cmp['diff'], sign=True)} [{figure(cmp['ci_low'])}, "
                 f"{figure(cmp['ci_high'])}] p={figure(cmp['p_value'], 2)} {cmp['direction']}")
    return cell


def print_report(report: dict[str, Any], console: Console | None = None) -> None:
    """Print an experiment's report (:func:`runtime.experiments.report.build_report`).

    Names, notes and cells are text, never rich markup: ``[interval]`` stays on screen.
    """
    from runtime.experiments.report import SAME_WITHIN

    out_ = console or out
    out_.print(f"experiment {report['name']} ({report['status']}) on dataset "
               f"{report['dataset']['name']} {report['dataset']['version']}: "
               f"{report['dataset']['cases']} cases x {report['repeat']}", highlight=False,
               markup=False)
    if report.get("note"):
        out_.print(f"note: {report['note']}", highlight=False, markup=False)
    runs = Table("variant", "trees", "failed", "calls paid", "replayed", "$ paid", "$ replayed",
                 "p50 s", "p90 s", "passed")
    for row in report["variants"]:
        runs.add_row(escape(row["name"]), str(row["trees"]), str(row["failed"]),
                     str(row["paid_calls"]), str(row["replayed_calls"]),
                     f"{row['cost_paid_usd']:.5f}", f"{row['cost_replayed_usd']:.5f}",
                     figure(row["latency_p50"]), figure(row["latency_p90"]),
                     figure(row["pass_rate"]))
    out_.print(runs)
    scores = Table("scorer", *(escape(row["name"]) for row in report["variants"]))
    for scorer in report["scorers"]:
        scores.add_row(escape(scorer),
                       *(escape(_score_cell(row, scorer)) for row in report["variants"]))
    out_.print(scores)
    out_.print("mean [95% interval]; against the baseline: difference [interval], paired "
               f"Wilcoxon p-value; within {SAME_WITHIN:.0%} of the baseline is the same",
               style="dim", highlight=False, markup=False)
    regressions = [c for c in report["cases"] if c["kind"] == "regression"]
    for c in regressions[:20]:
        out_.print(f"regression: {c['variant']} on {c['case_name']!r} ({c['scorer']} "
                   f"{figure(c['baseline'])} -> {figure(c['value'])}): {c['diff_command']}",
                   highlight=False, soft_wrap=True, markup=False)


def _show(runtime: Any, key: str, json_: bool, rule: tuple[str, float] | None = None) -> None:
    from runtime.experiments.report import worse_than_baseline

    report = _report(runtime, key)
    worse = worse_than_baseline(report, *rule) if rule else []
    if json_:
        print_json({**report, **({"worse": worse} if rule else {})})
    else:
        print_report(report)
    if worse:
        for w in worse:
            err.print(f"{w['variant']} is worse than the baseline on {rule[0]} "  # type: ignore[index]
                      f"({figure(w['diff'], sign=True)}, interval [{figure(w['ci_low'])}, "
                      f"{figure(w['ci_high'])}], p={figure(w['p_value'], 2)}); "
                      f"{len(w['regressions'])} case(s) regressed", markup=False,
                      highlight=False)
        raise typer.Exit(EXIT_FAILED)


def experiment_show(key: Annotated[str, typer.Argument(help="An experiment's name or id.")],
                    json_: JsonOpt = False, agents_module: ModulesOpt = None) -> None:
    """Print an experiment's report: scores with intervals, cost, regressions."""
    _show(open_runtime(agents_module), key, json_)


def experiment_list(json_: JsonOpt = False) -> None:
    """List experiments, newest first."""
    rows = _store().experiments.all()
    if json_:
        print_json([{"id": str(r["id"]), "name": r["name"], "status": r["status"],
                     "dataset": r["dataset_name"], "version": r["dataset_version"],
                     "trees": r["trees"], "created_at": r["created_at"].isoformat()}
                    for r in rows])
        return
    table = Table("name", "status", "dataset", "trees", "created")
    for r in rows:
        table.add_row(escape(r["name"]), r["status"],
                      escape(f"{r['dataset_name']} {r['dataset_version']}"),
                      str(r["trees"]), r["created_at"].strftime("%Y-%m-%d %H:%M"))
    out.print(table)


def experiment_rescore(
    key: Annotated[str, typer.Argument(help="An experiment's name or id.")],
    scorer_names: Annotated[list[str], typer.Option("--scorer", help="Scorers to add.")],
    json_: JsonOpt = False, agents_module: ModulesOpt = None,
) -> None:
    """Score an experiment's finished trees again with these scorers (no tree runs)."""
    from runtime.experiments.judges import lookup
    from runtime.experiments.runner import ExperimentRunner

    chosen = [lookup(n) for n in scorer_names]
    runtime = open_runtime(agents_module)
    experiment = runtime.store.experiments.get(key)
    if experiment is None:
        raise NotFound(f"no experiment {key!r}")
    runner = ExperimentRunner(runtime)
    install_stop_signals(runner.stop)  # judge scorers run trees
    written = runner.score(experiment["id"], chosen, tenant=experiment["tenant"])
    err.print(f"{written} score row(s) written", style="dim", markup=False, highlight=False)
    _show(runtime, key, json_)


def experiment_delete(
    key: Annotated[str, typer.Argument(help="An experiment's name or id.")],
    prune_trees: Annotated[bool, typer.Option(
        "--prune-trees", help="Delete its finished trees and their history too.")] = False,
) -> None:
    """Remove an experiment with its runs and scores; its trees stay unless --prune-trees."""
    store = _store()
    experiment = store.experiments.get(key)
    if experiment is None:
        fail(f"no experiment {key!r}")
    roots = [r["root_id"] for r in store.experiments.runs(experiment["id"])]
    store.experiments.delete(experiment["id"])
    if not prune_trees:
        out.print(f"experiment {experiment['name']} removed; its {len(roots)} trees stay "
                  "(--prune-trees deletes them)", highlight=False, markup=False)
        return
    trees, tasks = store.reads.prune_trees(roots)
    out.print(f"experiment {experiment['name']} removed with {trees} trees ({tasks} tasks)"
              + (f"; {len(roots) - trees} still open stay" if trees < len(roots) else ""),
              highlight=False, markup=False)
