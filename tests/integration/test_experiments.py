"""Experiments: a dataset run under variants on the seed's org (offline backend, real
PostgreSQL), forks replaying the unchanged calls, scores and a report, resume, bad input.

The worked example of docs/experiments.md (docs/examples/experiments/) is what runs here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections import Counter
from decimal import Decimal
from pathlib import Path

import pytest

from runtime.config import load_settings
from runtime.errors import BadInput
from runtime.experiments.datasets import parse_cases, read_cases, version_of
from runtime.experiments.judges import lookup, shown_first
from runtime.experiments.report import build_report, worse_than_baseline
from runtime.experiments.runner import ExperimentPlan, ExperimentRunner
from runtime.experiments.scorers import DEFAULT_SCORERS, SCORERS, RunOutcome, scorer
from runtime.experiments.variants import check_variants, parse_variants, read_variants
from runtime.store.store import Store
from runtime.wiring import Runtime, build_runtime
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "experiments"
MODULE = "docs.examples.experiments.scouts_v2"


@pytest.fixture
def runtime(db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch) -> Runtime:
    monkeypatch.chdir(ROOT)
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "offline"})
    return build_runtime(settings, [MODULE], store=store)


def example_plan(runtime: Runtime, name: str, **extra: object) -> ExperimentPlan:
    """An experiment ``name`` over the example's dataset and variants (``extra``: its fields)."""
    cases = read_cases(EXAMPLE / "market_goals.jsonl")
    dataset_id, _ = runtime.store.experiments.dataset_put("market_goals", version_of(cases), "test",
                                                          [c.body for c in cases])
    variants = read_variants(EXAMPLE / "variants.toml")
    check_variants(variants, runtime.registry, runtime.settings)
    return ExperimentPlan(name=name, dataset_id=dataset_id, cases=cases, variants=variants,
                          scorers=[SCORERS[n] for n in DEFAULT_SCORERS],
                          timeout_seconds=120, **extra)  # type: ignore[arg-type]


def _report(runtime: Runtime, name: str) -> dict:
    store = runtime.store
    experiment = store.experiments.get(name)
    assert experiment is not None
    return build_report(experiment, store.experiments.runs(experiment["id"]),
                        store.experiments.scores(experiment["id"]),
                        ExperimentRunner(runtime).outcomes(experiment["id"]),
                        store.experiments.dataset_cases(experiment["dataset_id"]))


def test_a_variant_pays_only_for_the_calls_it_changed(runtime: Runtime) -> None:
    summary = ExperimentRunner(runtime).run(example_plan(runtime, "sharper"))
    assert summary.started == 6 and summary.stopped is None
    report = _report(runtime, "sharper")
    assert report["status"] == "finished"
    base, variant = report["variants"]
    assert (base["name"], variant["name"]) == ("baseline", "sharper_trends")
    assert base["trees"] == variant["trees"] == 3
    assert base["replayed_calls"] == 0 and base["failed"] == 0
    # The swapped scout's call changed, and so did the aggregates above it (their children's
    # answers changed); the other scouts' calls and the judge's were replayed.
    assert 0 < variant["paid_calls"] < base["paid_calls"]
    assert variant["paid_calls"] + variant["replayed_calls"] == base["paid_calls"]
    # Replayed calls are valued at what their record cost: the variant's whole cost is the
    # baseline's, give or take what the changed calls cost.
    assert variant["cost_replayed_usd"] > 0
    assert variant["cost_paid_usd"] < base["cost_paid_usd"]
    with runtime.store.engine.connect() as conn:
        swapped = conn.exec_driver_sql(
            "SELECT count(*) FROM tasks t JOIN experiment_runs r ON r.root_id = t.root_id "
            "WHERE r.variant = 'sharper_trends' AND t.to_agent = 'trend_analyst_v2'").scalar()
        seed = conn.exec_driver_sql(
            "SELECT count(*) FROM tasks t JOIN experiment_runs r ON r.root_id = t.root_id "
            "WHERE r.variant = 'sharper_trends' AND t.to_agent = 'trend_analyst'").scalar()
    assert (swapped, seed) == (3, 0)
    assert set(report["scorers"]) == {"done", "verdict", "cost_usd", "latency_s", "tokens",
                                      "expected"}
    done = variant["scores"]["done"]
    assert done["mean"] == 1.0 and done["n"] == 3
    assert variant["vs_baseline"]["done"]["direction"] == "same"


def test_a_rerun_of_the_same_experiment_starts_no_tree_twice(runtime: Runtime) -> None:
    plan = example_plan(runtime, "twice")
    first = ExperimentRunner(runtime).run(plan)
    calls_before = runtime.store.database.query("experiment_spend",
                                                experiment_id=first.experiment_id)[0]["spent"]
    again = ExperimentRunner(runtime).run(plan)
    assert (again.started, again.resumed) == (0, 6)
    assert runtime.store.experiments.spend(first.experiment_id) == Decimal(calls_before)
    assert len(runtime.store.experiments.runs(first.experiment_id)) == 6


def test_rescoring_adds_rows_without_running_a_tree(runtime: Runtime) -> None:
    plan = example_plan(runtime, "rescored")
    plan = ExperimentPlan(**{**plan.__dict__, "scorers": [SCORERS["done"]]})
    summary = ExperimentRunner(runtime).run(plan)
    trees = {r["root_id"] for r in runtime.store.experiments.runs(summary.experiment_id)}
    assert {s["scorer"] for s in runtime.store.experiments.scores(summary.experiment_id)} == {
        "done"}
    written = ExperimentRunner(runtime).score(summary.experiment_id, [SCORERS["tokens"]])
    assert written == 6
    assert {s["scorer"] for s in runtime.store.experiments.scores(summary.experiment_id)} == {
        "done", "tokens"}
    assert {r["root_id"] for r in runtime.store.experiments.runs(summary.experiment_id)} == trees


def test_the_budget_stops_new_trees_and_says_so(runtime: Runtime) -> None:
    plan = example_plan(runtime, "cheap", budget_usd=Decimal("0.0001"))
    summary = ExperimentRunner(runtime).run(plan)
    assert summary.stopped and "budget reached" in summary.stopped
    report = _report(runtime, "cheap")
    assert report["status"] == "stopped" and "budget reached" in report["note"]
    assert sum(v["trees"] for v in report["variants"]) < 6


def test_fail_if_worse_names_a_variant_worse_beyond_its_interval() -> None:
    report = {"variants": [
        {"name": "baseline", "vs_baseline": {}},
        {"name": "v2", "vs_baseline": {"done": {"diff": -0.5, "ci_low": -0.8, "ci_high": -0.2,
                                                "p_value": 0.03, "n": 8,
                                                "direction": "worse"}}}],
              "cases": [{"variant": "v2", "scorer": "done", "kind": "regression", "case": 1}]}
    worse = worse_than_baseline(report, "done")
    assert [w["variant"] for w in worse] == ["v2"] and len(worse[0]["regressions"]) == 1
    assert worse_than_baseline(report, "done", margin=0.6) == []


@pytest.mark.parametrize(("text", "message"), [
    ("not json\n", "malformed JSON"),
    ('{"goal": ""}\n', "non-empty string"),
    ('{"goal": "x", "colour": 1}\n', "unknown key 'colour'"),
    ("# only a comment\n", "no cases"),
    ('{"expected": 1}\n', "needs 'goal'"),
])
def test_a_bad_dataset_line_is_named(text: str, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        parse_cases(text, "cases.jsonl")


@pytest.mark.parametrize(("text", "message"), [
    ("[variants.v2]\nprompts = 'p/'\n", "not supported"),
    ("[variants.v2]\ncolour = 1\n", "unknown key 'colour'"),
    ("[variants.baseline]\nmodel = 'x'\n", "no overrides"),
    ("[variants.v2\n", "malformed TOML"),
    ("[tweaks.v2]\n", "unknown table"),
])
def test_a_bad_variants_file_is_named(text: str, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        parse_variants(text, "variants.toml")


def test_a_variant_naming_an_unknown_agent_or_model_is_refused(runtime: Runtime) -> None:
    with pytest.raises(BadInput, match="trend_analyst_v3"):
        check_variants(parse_variants("[variants.v]\nagents = {trend_analyst = "
                                      "'trend_analyst_v3'}\n"), runtime.registry,
                       runtime.settings)
    with pytest.raises(BadInput, match="unknown model"):
        check_variants(parse_variants("[variants.v]\nmodel = 'gpt-nothing'\n"),
                       runtime.registry, runtime.settings)
    with pytest.raises(BadInput, match="unknown scorer"):
        scorer("vibes")


def test_the_worked_example_runs_from_the_command_line(orgchart_env: dict[str, str],
                                                         tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "runtime.cli", "experiment", "run",
           str(EXAMPLE / "market_goals.jsonl"), "--variants", str(EXAMPLE / "variants.toml"),
           "--agents-module", MODULE, "--name", "docs-example", "--json",
           "--fail-if-worse", "done"]
    done = subprocess.run(cmd, cwd=ROOT, env=orgchart_env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [v["name"] for v in report["variants"]] == ["baseline", "sharper_trends"]
    assert report["worse"] == []
    bad = subprocess.run([*cmd[:5], str(tmp_path / "missing.jsonl")], cwd=ROOT,
                         env=orgchart_env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cannot read dataset" in bad.stderr
    shown = subprocess.run([sys.executable, "-m", "runtime.cli", "experiment", "show",
                            "docs-example", "--json", "--agents-module", MODULE], cwd=ROOT,
                           env=orgchart_env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["id"] == report["id"]


def test_model_judges_run_as_trees_recorded_once_with_the_order_shown(
        db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch,
        fake_ollama: FakeOllama) -> None:
    monkeypatch.chdir(ROOT)
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "ollama",
                                  "ORGCHART_OLLAMA__URL": fake_ollama.url})
    runtime = build_runtime(settings, [MODULE], store=store)
    plan = example_plan(runtime, "judged")
    plan = ExperimentPlan(**{**plan.__dict__,
                             "scorers": [lookup("done"), lookup("rubric"), lookup("pairwise")]})
    runner = ExperimentRunner(runtime)
    summary = runner.run(plan)
    runs = store.experiments.runs(summary.experiment_id)
    judged = Counter(r["variant"] for r in runs)
    # One rubric judge per tree, one pairwise judge per variant tree.
    assert judged == {"baseline": 3, "sharper_trends": 3, "rubric:baseline": 3,
                      "rubric:sharper_trends": 3, "pairwise:sharper_trends": 3}
    agents = {store.reads.get(r["root_id"])["to_agent"] for r in runs if ":" in r["variant"]}
    assert agents == {"judge", "pairwise_judge"}
    scores = store.experiments.scores(summary.experiment_id)
    rubric = [s for s in scores if s["scorer"] == "rubric"]
    assert len(rubric) == 6
    assert all(s["value"] is None or 0 <= s["value"] <= 1 for s in rubric)
    pairwise = [s for s in scores if s["scorer"] == "pairwise"]
    assert {s["variant"] for s in pairwise} == {"sharper_trends"}
    for s in pairwise:
        assert s["value"] is None or s["value"] in (0.0, 0.5, 1.0)
        if s["explanation"]:
            assert s["explanation"].split(" shown first")[0] in ("variant", "baseline")
    # Rescoring with the judges again starts no judge tree twice.
    before = len(store.experiments.runs(summary.experiment_id))
    runner.score(summary.experiment_id, [lookup("rubric"), lookup("pairwise")])
    assert len(store.experiments.runs(summary.experiment_id)) == before
    report = _report(runtime, "judged")
    assert [v["name"] for v in report["variants"]] == ["baseline", "sharper_trends"]
    assert report["variants"][0]["trees"] == 3  # the judges' trees are not the variant's


def test_the_order_a_pair_is_shown_in_is_drawn_at_random_and_kept() -> None:
    experiment = uuid.uuid4()
    outcomes = [RunOutcome({"goal": "g"}, "v2", 0, {"position": i}) for i in range(40)]
    first = [shown_first(experiment, o) for o in outcomes]
    assert first == [shown_first(experiment, o) for o in outcomes]  # the same on a resume
    assert 5 < first.count("variant") < 35  # both orders are drawn


def test_deleting_an_experiment_keeps_its_trees_unless_asked(runtime: Runtime) -> None:
    from typer.testing import CliRunner

    from runtime.cli.app import app

    kept = ExperimentRunner(runtime).run(example_plan(runtime, "kept"))
    pruned = ExperimentRunner(runtime).run(example_plan(runtime, "pruned"))
    kept_roots = [r["root_id"] for r in runtime.store.experiments.runs(kept.experiment_id)]
    pruned_roots = [r["root_id"] for r in runtime.store.experiments.runs(pruned.experiment_id)]
    env = {"ORGCHART_DATABASE_URL": runtime.settings.database.url or "",
           "ORGCHART_LLM__BACKEND": "offline"}
    cli = CliRunner()
    first = cli.invoke(app, ["experiment", "delete", "kept"], env=env)
    assert first.exit_code == 0, first.output
    assert "6 trees stay" in first.output
    second = cli.invoke(app, ["experiment", "delete", "pruned", "--prune-trees"], env=env)
    assert second.exit_code == 0, second.output
    assert "with 6 trees" in second.output
    assert runtime.store.experiments.get("kept") is None
    assert all(runtime.store.reads.get(r)["status"] == "done" for r in kept_roots)
    with runtime.store.engine.connect() as conn:
        left = conn.exec_driver_sql(
            "SELECT count(*) FROM tasks WHERE root_id = ANY(%(r)s)",
            {"r": pruned_roots}).scalar()
    assert left == 0
    assert cli.invoke(app, ["experiment", "delete", "kept"], env=env).exit_code == 2
