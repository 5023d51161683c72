"""The seed's org (ceo, intel_director, the three scouts) driven without a database.

A scripted function model stands in for ``ctx.llm`` (pydantic-ai's ``FunctionModel``
pattern): it answers each call with data for the requested schema, either scripted per
schema or generated from the schema (the smallest and the largest valid answer), and
records every prompt. ``drive`` plays the runtime in memory: run, delegate, run the
children, aggregate, exactly as the tree would unfold in the tasks table.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel

from agents import ceo, intel_director, scouts  # noqa: F401  (registers the org)
from agents.base import (
    AgentError,
    ChildSpec,
    ChildView,
    Delegate,
    Escalate,
    Result,
    RetryChildren,
    TaskView,
)
from agents.context import AgentContext
from agents.registry import registry
from agents.schemas import (
    CompetitorFindings,
    GoalRequest,
    IntelDraft,
    MarketFindings,
    Plan,
    ReportDraft,
    TrendFindings,
)
from runtime.llm.backends.schema_instance import instance_for_schema

GOAL = "Should we launch a managed PostgreSQL job queue for AI agent fleets?"
ORG = ("ceo", "intel_director", "competitor_scout", "market_researcher", "trend_analyst")
SCOUT_NAMES = ("competitor_scout", "market_researcher", "trend_analyst")

SCRIPT: dict[type[BaseModel], dict[str, Any]] = {
    Plan: {"brief": "Find who competes, how big the market is, and where it is heading.",
           "priorities": ["Who already sells this?", "Is the market growing?"]},
    ReportDraft: {"summary": "Launch, carefully.", "findings": ["Two incumbents."],
                  "recommendations": ["Start with a free tier."]},
    IntelDraft: {"summary": "A growing niche with two incumbents.",
                 "key_points": ["Incumbents are small."], "open_questions": []},
    CompetitorFindings: {"competitors": [{"name": "QueueCo", "positioning": "Cheap queues.",
                                          "threat": "medium"}], "notes": "Few players."},
    MarketFindings: {"market_size_estimate": "about 300M USD in 2025",
                     "segments": ["startups", "enterprises"], "drivers": ["agent adoption"]},
    TrendFindings: {"trends": [{"name": "Agent fleets", "direction": "rising",
                                "evidence": "More frameworks every month."}]},
}


# ---------------------------------------------------------------------------- helpers
from tests.schema_samples import sample  # noqa: E402


@dataclass
class Reply:
    """What ``ctx.llm.complete`` returns (the fields agents read)."""

    data: Any
    text: str
    backend: str
    model: str


@dataclass
class ScriptedLLM:
    """A function model. ``mode``: ``script`` (the SCRIPT answers), ``min``/``max`` (the
    smallest/largest schema-valid answer) or ``offline`` (the offline backend's generator);
    ``answers`` overrides per schema."""

    mode: str = "script"
    backend: str = "scripted"
    answers: dict[Any, Any] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def complete(self, prompt: str, *, schema: Any = None, system: str | None = None,
                 max_tokens: int | None = None) -> Reply:
        self.calls.append((prompt, schema))
        if schema in self.answers:
            data = self.answers[schema]
        elif self.mode == "script":
            data = SCRIPT[schema]
        elif self.mode == "offline":  # the offline backend's own generator
            data = instance_for_schema(schema.model_json_schema(), prompt)
        else:
            data = sample(schema.model_json_schema(), self.mode)
        return Reply(data=data, text=json.dumps(data), backend=self.backend,
                     model="scripted-1")

    def prompts_for(self, schema: Any) -> list[str]:
        return [p for p, s in self.calls if s is schema]


def make_task(agent: str, payload: dict[str, Any], phase: str = "run") -> TaskView:
    return TaskView(
        id=uuid.uuid4(), root_id=uuid.uuid4(), parent_id=None, agent=agent,
        type=registry.get(agent).types[0], payload=payload, depth=0, priority=5,
        budget_tokens=50_000, budget_seconds=300, budget_usd=Decimal(1), phase=phase,
    )


def make_ctx(llm: ScriptedLLM, task: TaskView, offline: bool = False) -> AgentContext:
    return AgentContext(llm=llm, task=task, log=logging.getLogger("test.agents"),
                        offline=offline)


def child_view(spec: ChildSpec, status: str = "done", result: Any = None,
               error: str | None = None) -> ChildView:
    return ChildView(id=uuid.uuid4(), agent=spec.agent, type=spec.type, key=spec.key,
                     status=status, payload=spec.payload, result=result, error=error,
                     verdict=None, spent_tokens=0, spent_usd=Decimal(0))


def retried(view: ChildView) -> ChildView:
    """The same child after a retry that broke the same way again."""
    return replace(view, retries=view.retries + 1)


def check_output(agent: str, output: Any) -> dict[str, Any]:
    """The result must be JSON and valid for the agent's output model."""
    assert isinstance(output, dict)
    json.dumps(output)
    registry.get(agent).output_model.model_validate(output)
    return output


def drive(agent: str, payload: dict[str, Any], llm: ScriptedLLM,
          broken: dict[str, str] | None = None, offline: bool = False) -> Any:
    """Run ``agent`` as the runtime would; ``broken`` maps child keys to a bad status."""
    broken = broken or {}
    registry.validate_input(agent, payload)
    cls = registry.get(agent)
    task = make_task(agent, payload)
    outcome = cls().run(make_ctx(llm, task, offline), task)
    if isinstance(outcome, Delegate):
        views = []
        for spec in outcome.children:
            assert spec.agent in cls.delegates_to
            if spec.key in broken:
                views.append(child_view(spec, broken[spec.key], error=f"{spec.key} broke"))
                continue
            sub = drive(spec.agent, spec.payload, llm, broken, offline)
            if isinstance(sub, Result):
                views.append(child_view(spec, "done", sub.output))
            else:
                views.append(child_view(spec, "escalated", error=sub.reason))
        aggregating = replace(task, phase="aggregate")
        outcome = cls().aggregate(make_ctx(llm, aggregating, offline), aggregating, views)
        for _ in range(3):  # a retried child that was broken breaks again
            if not isinstance(outcome, RetryChildren):
                break
            assert outcome.child_ids and outcome.reassign_to is None
            views = [retried(v) if v.id in outcome.child_ids else v for v in views]
            outcome = cls().aggregate(make_ctx(llm, aggregating, offline), aggregating, views)
    if isinstance(outcome, Result):
        check_output(agent, outcome.output)
    return outcome


# ---------------------------------------------------------------------------- registry
def test_the_seed_org_is_registered_with_its_edges_and_types() -> None:
    assert set(ORG) <= set(registry.names())
    assert registry.get("ceo").types == ("goal",)
    assert registry.get("ceo").delegates_to == ("intel_director",)
    assert set(registry.get("intel_director").delegates_to) == set(SCOUT_NAMES)
    for name in ("intel_director", *SCOUT_NAMES):
        assert registry.get(name).types == ("research",)
    for name in SCOUT_NAMES:
        assert registry.get(name).delegates_to == ()
    described = {d["name"]: d for d in registry.describe()}
    assert described["ceo"]["input_schema"]["required"] == ["goal"]
    assert "offline" in described["trend_analyst"]["output_schema"]["properties"]


@pytest.mark.parametrize("schema", [Plan, ReportDraft, IntelDraft, CompetitorFindings,
                                    MarketFindings, TrendFindings])
def test_model_facing_schemas_require_every_field_and_leave_out_offline(
        schema: type[BaseModel]) -> None:
    js = schema.model_json_schema()
    for obj in [js, *js.get("$defs", {}).values()]:
        assert set(obj.get("required", [])) == set(obj["properties"]), obj.get("title")
    assert "offline" not in js["properties"]


def test_ceo_refuses_an_empty_or_oversized_goal_and_unknown_keys() -> None:
    for bad in ({"goal": ""}, {"goal": "x" * 4001}, {"goal": "ok", "goals": "typo"}, {}):
        with pytest.raises(Exception, match="input schema"):
            registry.validate_input("ceo", bad)


# ---------------------------------------------------------------------------- ceo
def test_ceo_plans_then_delegates_one_research_task_to_the_director() -> None:
    llm = ScriptedLLM()
    task = make_task("ceo", {"goal": GOAL, "context": {"region": "EU"}})
    out = registry.get("ceo")().run(make_ctx(llm, task), task)

    assert isinstance(out, Delegate)
    [spec] = out.children
    assert (spec.agent, spec.type, spec.key) == ("intel_director", "research", "intel")
    assert spec.budget_tokens is None and spec.budget_usd is None
    registry.validate_input("intel_director", spec.payload)
    assert spec.payload["goal"] == GOAL
    assert spec.payload["context"] == {"region": "EU"}
    assert SCRIPT[Plan]["brief"] in spec.payload["brief"]
    assert "- Is the market growing?" in spec.payload["brief"]
    [(prompt, schema)] = llm.calls
    assert schema is Plan and GOAL in prompt and '"region": "EU"' in prompt


def test_ceo_reports_from_a_done_director_naming_every_source() -> None:
    llm = ScriptedLLM()
    out = drive("ceo", {"goal": GOAL}, llm)

    assert isinstance(out, Result)
    report = out.output
    assert report["summary"] == SCRIPT[ReportDraft]["summary"]
    assert report["sources"] == ["intel_director", *sorted(SCOUT_NAMES)]
    assert report["gaps"] == [] and report["offline"] is False
    [report_prompt] = llm.prompts_for(ReportDraft)
    assert "A growing niche with two incumbents." in report_prompt  # the director's brief
    assert "QueueCo" in report_prompt  # and the scouts' findings inside it


@pytest.mark.parametrize("status", ["failed", "escalated"])
def test_ceo_escalates_with_the_directors_error_when_research_did_not_succeed(
        status: str) -> None:
    llm = ScriptedLLM()
    task = make_task("ceo", {"goal": GOAL}, phase="aggregate")
    spec = ChildSpec(agent="intel_director", type="research", key="intel",
                     payload={"goal": GOAL})
    out = registry.get("ceo")().aggregate(
        make_ctx(llm, task), task, [child_view(spec, status, error="timeout")])

    assert isinstance(out, Escalate)
    assert f"intel_director {status}: timeout" in out.reason
    assert llm.calls == []


def test_ceo_passes_the_directors_gaps_into_the_report() -> None:
    out = drive("ceo", {"goal": GOAL}, ScriptedLLM(), broken={"market": "failed"})

    assert isinstance(out, Result)
    assert out.output["gaps"] == ["market_researcher (market) failed: market broke"]
    assert "market_researcher" not in out.output["sources"]


# ---------------------------------------------------------------------------- director
def test_director_fans_out_three_focused_questions_in_parallel() -> None:
    llm = ScriptedLLM()
    payload = {"goal": GOAL + "\nMore detail on a second line.", "brief": "Need numbers."}
    task = make_task("intel_director", payload)
    out = registry.get("intel_director")().run(make_ctx(llm, task), task)

    assert isinstance(out, Delegate)
    by_key = {c.key: c for c in out.children}
    assert {k: c.agent for k, c in by_key.items()} == {
        "competitors": "competitor_scout", "market": "market_researcher",
        "trends": "trend_analyst"}
    questions = {c.payload["question"] for c in out.children}
    assert len(questions) == 3
    for spec in out.children:
        assert spec.type in registry.get(spec.agent).types
        assert spec.budget_tokens is None and spec.budget_seconds is None
        registry.validate_input(spec.agent, spec.payload)
        assert spec.payload["brief"] == "Need numbers."
        assert spec.payload["goal"] == payload["goal"]
        assert GOAL.rstrip("?") in spec.payload["question"]
        assert "second line" not in spec.payload["question"]
    assert llm.calls == []  # fan-out is deterministic: a re-run asks for the same children


def test_director_merges_three_done_scouts() -> None:
    llm = ScriptedLLM()
    out = drive("intel_director", {"goal": GOAL, "brief": "b"}, llm)

    assert isinstance(out, Result)
    brief = out.output
    assert brief["sources"] == sorted(SCOUT_NAMES)
    assert brief["gaps"] == []
    assert set(brief["findings"]) == {"competitors", "market", "trends"}
    assert brief["findings"]["competitors"]["competitors"][0]["name"] == "QueueCo"
    [merge_prompt] = llm.prompts_for(IntelDraft)
    assert "agent adoption" in merge_prompt and "every scout answered" in merge_prompt


@pytest.mark.parametrize("status", ["failed", "escalated"])
def test_director_tolerates_one_missing_scout_and_names_the_gap(status: str) -> None:
    llm = ScriptedLLM()
    out = drive("intel_director", {"goal": GOAL}, llm, broken={"trends": status})

    assert isinstance(out, Result)
    assert out.output["gaps"] == [f"trend_analyst (trends) {status}: trends broke"]
    assert out.output["sources"] == ["competitor_scout", "market_researcher"]
    assert "trends" not in out.output["findings"]
    [merge_prompt] = llm.prompts_for(IntelDraft)
    assert "trend_analyst (trends)" in merge_prompt


def test_director_escalates_when_two_scouts_failed_without_calling_the_model() -> None:
    llm = ScriptedLLM()
    out = drive("intel_director", {"goal": GOAL}, llm,
                broken={"market": "failed", "competitors": "escalated"})

    assert isinstance(out, Escalate)
    assert out.reason.startswith("2 of 3 scouts did not succeed")
    assert "market_researcher (market) failed: market broke" in out.reason
    assert "competitor_scout (competitors) escalated: competitors broke" in out.reason
    assert llm.prompts_for(IntelDraft) == []


def test_director_retries_failed_scouts_once_before_escalating() -> None:
    llm = ScriptedLLM()
    cls = registry.get("intel_director")
    task = replace(make_task("intel_director", {"goal": GOAL}), phase="aggregate")
    specs = cls().run(make_ctx(llm, task, False), task).children
    views = [child_view(spec, "failed" if spec.key in ("market", "trends") else
                        "escalated" if spec.key == "competitors" else "done",
                        error=f"{spec.key} broke") for spec in specs]
    first = cls().aggregate(make_ctx(llm, task, False), task, views)
    assert isinstance(first, RetryChildren)
    by_key = {v.key: v.id for v in views}
    # Failed scouts get one more try; an escalated one waits for a person.
    assert set(first.child_ids) == {by_key["market"], by_key["trends"]}
    again = [retried(v) if v.id in first.child_ids else v for v in views]
    second = cls().aggregate(make_ctx(llm, task, False), task, again)
    assert isinstance(second, Escalate)
    assert second.reason.startswith("3 of 3 scouts did not succeed")


def test_an_escalating_director_makes_the_ceo_escalate() -> None:
    out = drive("ceo", {"goal": GOAL}, ScriptedLLM(),
                broken={"market": "failed", "trends": "failed"})

    assert isinstance(out, Escalate)
    assert "research did not succeed: intel_director escalated: 2 of 3 scouts" in out.reason


# ---------------------------------------------------------------------------- scouts
@pytest.mark.parametrize("name", SCOUT_NAMES)
def test_scout_answers_its_question_once_and_labels_the_backend(name: str) -> None:
    llm = ScriptedLLM()
    payload = {"goal": GOAL, "question": "Exactly this question?", "brief": "The brief."}
    out = drive(name, payload, llm)

    assert isinstance(out, Result) and out.output["offline"] is False
    [(prompt, schema)] = llm.calls
    assert schema is registry.get(name).findings_model  # type: ignore[attr-defined]
    assert "Exactly this question?" in prompt and "The brief." in prompt and GOAL in prompt
    offline = drive(name, payload, ScriptedLLM(backend="offline"))
    assert isinstance(offline, Result) and offline.output["offline"] is True


@pytest.mark.parametrize("name", SCOUT_NAMES)
def test_scout_run_alone_with_just_a_goal_asks_its_default_question(name: str) -> None:
    llm = ScriptedLLM()
    out = drive(name, {"goal": GOAL}, llm)

    assert isinstance(out, Result)
    [(prompt, _)] = llm.calls
    assert registry.get(name).default_question in prompt  # type: ignore[attr-defined]


def test_a_scouts_answer_that_breaks_its_schema_fails_the_task_with_the_reason() -> None:
    llm = ScriptedLLM(answers={TrendFindings: {"trends": [{"name": "x", "direction": "up",
                                                           "evidence": ""}]}})
    with pytest.raises(AgentError, match=r"trend_analyst: .*TrendFindings: trends\.0\.direction"):
        drive("trend_analyst", {"goal": GOAL}, llm)


def test_an_answer_that_is_not_json_fails_the_task_with_the_text_quoted() -> None:
    class TextOnly(ScriptedLLM):
        def complete(self, prompt: str, **kw: Any) -> Reply:
            return Reply(data=None, text="I cannot help", backend="ollama", model="m")

    with pytest.raises(AgentError, match="not JSON for MarketFindings: 'I cannot help'"):
        drive("market_researcher", {"goal": GOAL}, TextOnly())


# ---------------------------------------------------------------------------- offline, any data
@pytest.mark.parametrize("mode", ["min", "max"])
def test_the_whole_org_accepts_any_schema_valid_answer(mode: str) -> None:
    """The offline backend (or a real model) may answer with empty lists or odd strings."""
    llm = ScriptedLLM(mode=mode)
    payload = sample(GoalRequest.model_json_schema(), mode)  # a 1- or 4000-character goal
    out = drive("ceo", payload, llm)

    assert isinstance(out, Result)
    assert [s for _, s in llm.calls].count(ReportDraft) == 1
    assert len(llm.calls) == 1 + 3 + 1 + 1  # plan, three scouts, merge, report
    for _, schema in llm.calls:  # the generated answers really were schema-valid
        jsonschema.validate(sample(schema.model_json_schema(), mode),
                            schema.model_json_schema())


def test_offline_answers_are_labelled_all_the_way_up() -> None:
    out = drive("ceo", {"goal": GOAL}, ScriptedLLM(backend="offline"))
    assert isinstance(out, Result) and out.output["offline"] is True


def test_the_org_runs_on_the_offline_backends_generated_answers() -> None:
    llm = ScriptedLLM(mode="offline", backend="offline")
    out = drive("ceo", {"goal": GOAL}, llm)

    assert isinstance(out, Result)
    assert out.output["offline"] is True
    assert out.output["summary"].startswith("offline: ")
    assert out.output["sources"] == ["intel_director", *sorted(SCOUT_NAMES)]


def test_one_offline_scout_marks_the_brief_offline() -> None:
    llm = ScriptedLLM()
    task = make_task("intel_director", {"goal": GOAL}, phase="aggregate")
    done = [
        child_view(ChildSpec(agent=agent, type="research", key=key, payload={}), "done",
                   {**SCRIPT[findings], "offline": offline})
        for key, agent, findings, offline in [
            ("competitors", "competitor_scout", CompetitorFindings, False),
            ("market", "market_researcher", MarketFindings, False),
            ("trends", "trend_analyst", TrendFindings, True),
        ]
    ]
    merged = registry.get("intel_director")().aggregate(make_ctx(llm, task), task, done)
    assert isinstance(merged, Result) and merged.output["offline"] is True
    done[2] = replace(done[2], result={**SCRIPT[TrendFindings], "offline": False})
    merged = registry.get("intel_director")().aggregate(make_ctx(llm, task), task, done)
    assert isinstance(merged, Result) and merged.output["offline"] is False


def test_the_context_offline_flag_labels_outputs_whatever_the_reply_says() -> None:
    out = drive("market_researcher", {"goal": GOAL}, ScriptedLLM(), offline=True)
    assert isinstance(out, Result) and out.output["offline"] is True
