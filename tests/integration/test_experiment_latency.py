"""An experiment's ``latency_s`` counts a replayed call at the time it took when made.

A variant that changes nothing is a fork of the baseline whose every call is replayed
from the record, instantly. Its latency must still be the baseline's (give or take its
own overhead), not ~0: replay is how an experiment saves money, not how a variant wins.
The model is the fake Ollama server with a delay per call, so the calls take real time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.config import load_settings
from runtime.experiments.datasets import read_cases, version_of
from runtime.experiments.report import build_report
from runtime.experiments.runner import ExperimentPlan, ExperimentRunner
from runtime.experiments.scorers import DEFAULT_SCORERS, SCORERS, replayed_path
from runtime.experiments.variants import Variant
from runtime.store.store import Store
from runtime.wiring import build_runtime
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "experiments"
MODULE = "docs.examples.experiments.scouts_v2"
#: The fake model's time per call: what the baseline's calls take, and replays do not.
CALL_SECONDS = 0.3


def _baseline_path(store: Store, root_id: Any) -> float:
    """The baseline tree's call time along its slowest path, from its own records."""
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT t.root_id, t.id, t.parent_id, COALESCE(sum(m.duration_seconds), 0) "
            "AS replayed_seconds FROM tasks t LEFT JOIN model_calls m ON m.task_id = t.id "
            "WHERE t.root_id = %(root)s GROUP BY t.root_id, t.id, t.parent_id",
            {"root": root_id}).mappings().all()
    return replayed_path([dict(r) for r in rows])[root_id]


def test_a_fully_replayed_variant_is_as_slow_as_the_baseline(
        db_url: str, store: Store, fake_ollama: FakeOllama,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    fake_ollama.delay_seconds = CALL_SECONDS
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "ollama",
                                  "ORGCHART_OLLAMA__URL": fake_ollama.url})
    runtime = build_runtime(settings, [MODULE], store=store)
    cases = read_cases(EXAMPLE / "market_goals.jsonl")[:1]
    dataset_id, _ = store.experiments.dataset_put("one_goal", version_of(cases), "test",
                                                  [c.body for c in cases])
    plan = ExperimentPlan(name="replayed", dataset_id=dataset_id, cases=cases,
                          variants=[Variant("baseline"), Variant("again")],
                          scorers=[SCORERS[n] for n in DEFAULT_SCORERS], timeout_seconds=300)
    runner = ExperimentRunner(runtime)
    summary = runner.run(plan)
    outcomes = {o.variant: o for o in runner.outcomes(summary.experiment_id)}
    base, again = outcomes["baseline"], outcomes["again"]
    assert base.root["paid_calls"] > 0 and base.root["replayed_calls"] == 0
    assert again.root["paid_calls"] == 0
    assert again.root["replayed_calls"] == base.root["paid_calls"]

    # Every replayed call counts what its counterpart took, along the slowest path.
    path = _baseline_path(store, base.root["root_id"])
    assert path > CALL_SECONDS  # calls one after another: the root's, then below
    assert again.replayed_seconds == pytest.approx(path)
    assert again.latency_seconds is not None and again.wall_seconds is not None
    assert again.latency_seconds == pytest.approx(again.wall_seconds + path)
    assert base.replayed_seconds == 0 and base.latency_seconds == base.wall_seconds
    # Replayed instantly, it is as slow as the baseline but for their overheads (the
    # baseline's is its wall time beyond its calls): before, its wall time alone, a
    # fraction of the baseline's.
    assert base.latency_seconds is not None and base.latency_seconds >= path
    assert again.latency_seconds >= path

    experiment = store.experiments.get("replayed")
    assert experiment is not None
    report = build_report(experiment, store.experiments.runs(experiment["id"]),
                          store.experiments.scores(experiment["id"]),
                          runner.outcomes(experiment["id"]),
                          store.experiments.dataset_cases(experiment["dataset_id"]))
    latency = {v["name"]: v["latency_p50"] for v in report["variants"]}
    assert latency["again"] == pytest.approx(again.latency_seconds)
    scores = {(s["variant"], s["scorer"]): s for s in store.experiments.scores(experiment["id"])}
    assert scores[("again", "latency_s")]["value"] == pytest.approx(again.latency_seconds)
    assert "replayed calls as recorded" in scores[("again", "latency_s")]["explanation"]


def test_the_replayed_path_is_a_tasks_own_time_then_its_slowest_child() -> None:
    rows = [
        {"root_id": "r", "id": "r", "parent_id": None, "replayed_seconds": 1.0},
        {"root_id": "r", "id": "a", "parent_id": "r", "replayed_seconds": 2.0},
        {"root_id": "r", "id": "b", "parent_id": "r", "replayed_seconds": 0.5},
        {"root_id": "r", "id": "b1", "parent_id": "b", "replayed_seconds": 3.0},
        {"root_id": "s", "id": "s", "parent_id": None, "replayed_seconds": 0},
    ]
    assert replayed_path(rows) == {"r": 1.0 + 0.5 + 3.0, "s": 0.0}
