"""The judge stage: kill criteria, then schema and checks, then a rubric scored by a model.

Models are scripted stand-ins (no live model). Judging a real row read back from
PostgreSQL is in ``tests/integration/test_judge_stage_rows.py``.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest

from agents.base import Result, TaskView
from agents.context import AgentContext, render_prompt
from agents.judge import Judge, JudgeOutput, score_rubric
from runtime.config import Settings
from runtime.engine.judge_stage import judge_task
from runtime.errors import LeaseLost, TransientModelError, UnknownPrice

SETTINGS = Settings()
NOW = dt.datetime(2026, 6, 1, 12, 0, tzinfo=dt.UTC)


@dataclass
class Completion:
    data: Any
    model: str
    offline: bool = False


@dataclass
class ScriptedLLM:
    """Answers every call with ``answer`` (or raises ``raises``); records the prompts."""

    answer: Any = None
    raises: Exception | None = None
    model: str = "judge-model:1b"
    offline: bool = False
    prompts: list[str] = field(default_factory=list)
    schemas: list[Any] = field(default_factory=list)

    def complete(self, prompt: str, *, schema: Any = None, system: str | None = None,
                 max_tokens: int | None = None) -> Completion:
        self.prompts.append(prompt)
        self.schemas.append(schema)
        if self.raises is not None:
            raise self.raises
        return Completion(self.answer, self.model, self.offline)


def row(result: Any = None, success: Any = None, kill: Any = None, **extra: Any) -> dict[str, Any]:
    task: dict[str, Any] = {
        "id": uuid.uuid4(), "to_agent": "competitor_scout", "type": "task",
        "payload": {"goal": "find Acme's prices"}, "result": result,
        "success_criteria": success, "kill_criteria": kill, "spent_tokens": 0,
        "spent_usd": Decimal("0"), "duration_seconds": 0.0,
        "created_at": NOW - dt.timedelta(minutes=5), "status": "judging",
    }
    task.update(extra)
    return task


def judge(task: dict[str, Any], children: list[dict[str, Any]] | None = None,
          llm: Any = None) -> Any:
    return judge_task(task, children or [], llm, SETTINGS, now=NOW)


# ---------------------------------------------------------------------- no criteria
def test_no_criteria_is_done_with_the_rules_verdict() -> None:
    judgement = judge(row({"text": "anything"}))
    assert judgement.to_status == "done" and judgement.error is None
    assert judgement.verdict == {"passed": True, "score": 1.0,
                                 "reasons": ["no success criteria: accepted"],
                                 "judge": "rules", "checks": []}


# ---------------------------------------------------------------------- kill criteria
@pytest.mark.parametrize(("kill", "extra", "children", "needle"), [
    ({"max_cost_usd": 0.5}, {"spent_usd": Decimal("0.52")}, [],
     "max_cost_usd: spent $0.52 > limit $0.5"),
    ({"max_tokens": 1000}, {"spent_tokens": 1500}, [], "spent 1500 tokens > limit 1000"),
    ({"max_seconds": 30}, {"duration_seconds": 31.5}, [], "worked 31.5 s > limit 30 s"),
    ({"max_child_failures": 1}, {}, ["done", "failed", "escalated"],
     "2 of 3 children failed or escalated > limit 1"),
    ({"deadline": "2026-06-01T11:00:00Z"}, {}, [], "after the deadline 2026-06-01T11:00:00"),
    ({"deadline": "2026-06-01T13:59:59+02:00"}, {}, [], "after the deadline"),
])
def test_each_kill_criterion_escalates_naming_it_and_the_figures(
        kill: dict[str, Any], extra: dict[str, Any], children: list[str], needle: str) -> None:
    kids = [{"id": uuid.uuid4(), "status": s} for s in children]
    judgement = judge(row({"text": "x"}, kill=kill, **extra), kids)
    assert judgement.to_status == "escalated"
    assert judgement.error is not None and judgement.error.startswith("kill criteria: ")
    assert needle in judgement.error
    assert judgement.verdict["passed"] is False
    assert judgement.verdict["kill"][0]["criterion"] == next(iter(kill))


@pytest.mark.parametrize(("kill", "extra", "children"), [
    ({"max_cost_usd": 0.5}, {"spent_usd": Decimal("0.5")}, []),
    ({"max_tokens": 1000}, {"spent_tokens": 1000}, []),
    ({"max_seconds": 30}, {"duration_seconds": 30.0}, []),
    ({"max_child_failures": 1}, {}, ["done", "failed"]),
    ({"deadline": "2026-06-01T12:00:00Z"}, {}, []),
    ({"deadline": "2026-06-01T14:00:00+02:00"}, {}, []),
])
def test_a_figure_at_the_limit_does_not_kill(kill: dict[str, Any], extra: dict[str, Any],
                                             children: list[str]) -> None:
    kids = [{"id": uuid.uuid4(), "status": s} for s in children]
    assert judge(row({"text": "x"}, kill=kill, **extra), kids).to_status == "done"


def test_every_hit_kill_criterion_is_listed() -> None:
    judgement = judge(row({"text": "x"}, kill={"max_tokens": 10, "max_cost_usd": 0.01},
                          spent_tokens=11, spent_usd=Decimal("0.02")))
    assert [h["criterion"] for h in judgement.verdict["kill"]] == ["max_cost_usd", "max_tokens"]
    assert len(judgement.verdict["reasons"]) == 2


def test_kill_criteria_come_before_a_failing_schema() -> None:
    judgement = judge(row({"text": 1}, success={"schema": {"type": "string"}},
                          kill={"max_tokens": 0}, spent_tokens=1))
    assert judgement.to_status == "escalated"


# ---------------------------------------------------------------------- schema and checks
SCHEMA = {"type": "object", "required": ["prices"],
          "properties": {"prices": {"type": "array", "items": {"type": "number"}}}}


def test_a_result_matching_the_schema_is_done() -> None:
    judgement = judge(row({"prices": [1, 2.5]}, success={"schema": SCHEMA}))
    assert judgement.to_status == "done"
    assert judgement.verdict["passed"] is True and judgement.verdict["judge"] == "rules"


def test_a_result_failing_the_schema_is_failed_with_the_paths() -> None:
    judgement = judge(row({"prices": [1, "two"]}, success={"schema": SCHEMA}))
    assert judgement.to_status == "failed"
    assert judgement.error is not None
    assert "$.prices[1]: 'two' is not of type 'number'" in judgement.error
    assert judgement.verdict["score"] == 0.0


def test_failed_checks_are_reported_and_scored_by_the_fraction_passed() -> None:
    checks = [{"path": "prices", "op": "len>=", "value": 3},
              {"path": "prices.0", "op": ">", "value": 0},
              {"path": "currency", "op": "==", "value": "USD"},
              {"path": "currency", "op": "exists"}]
    judgement = judge(row({"prices": [1, 2], "currency": "EUR"}, success={"checks": checks}))
    assert judgement.to_status == "failed"
    assert judgement.verdict["score"] == 0.5
    assert [c["passed"] for c in judgement.verdict["checks"]] == [False, True, False, True]
    assert judgement.error is not None
    assert "prices len>= 3 (length 2)" in judgement.error
    assert "currency == \"USD\" (got 'EUR')" in judgement.error


def test_passing_checks_are_done() -> None:
    checks = [{"path": "prices", "op": "len>=", "value": 2}]
    judgement = judge(row({"prices": [1, 2]}, success={"schema": SCHEMA, "checks": checks}))
    assert judgement.to_status == "done"
    assert judgement.verdict["checks"][0]["passed"] is True
    assert "all 1 checks passed" in judgement.verdict["reasons"]


def test_malformed_criteria_in_a_row_escalate_instead_of_crashing() -> None:
    judgement = judge(row({"a": 1}, success={"checks": [{"path": "a", "op": "~", "value": 1}]}))
    assert judgement.to_status == "escalated"
    assert judgement.error is not None and "malformed criteria" in judgement.error


# ---------------------------------------------------------------------- rubric
RUBRIC = {"text": "Are the prices sourced?", "threshold": 0.7}


def answer(score: float, uncertain: bool = False) -> dict[str, Any]:
    return {"score": score, "passed": score >= 0.5, "reasons": ["cites two sources"],
            "uncertain": uncertain}


def test_a_rubric_score_at_the_threshold_is_done_and_names_the_model() -> None:
    llm = ScriptedLLM(answer(0.7))
    judgement = judge(row({"prices": [1]}, success={"rubric": RUBRIC}), llm=llm)
    assert judgement.to_status == "done"
    assert judgement.verdict["judge"] == "judge-model:1b"
    assert judgement.verdict["score"] == 0.7
    assert "cites two sources" in judgement.verdict["reasons"]
    assert llm.schemas == [JudgeOutput]
    assert "Are the prices sourced?" in llm.prompts[0]
    assert "find Acme's prices" in llm.prompts[0]


def test_a_rubric_score_below_the_threshold_is_failed_whatever_the_model_says() -> None:
    judgement = judge(row({"prices": [1]}, success={"rubric": RUBRIC}),
                      llm=ScriptedLLM(answer(0.6)))
    assert judgement.to_status == "failed"
    assert judgement.verdict["passed"] is False
    assert judgement.error == "judge: rubric score 0.6 (threshold 0.7) is below the threshold"


def test_an_uncertain_judge_escalates() -> None:
    judgement = judge(row({"prices": [1]}, success={"rubric": RUBRIC}),
                      llm=ScriptedLLM(answer(0.9, uncertain=True)))
    assert judgement.to_status == "escalated"
    assert judgement.verdict["uncertain"] is True
    assert judgement.error is not None and "uncertain" in judgement.error


def test_an_offline_answer_is_never_taken_as_a_judgement() -> None:
    llm = ScriptedLLM(answer(1.0), offline=True, model="offline")
    judgement = judge(row({"prices": [1]}, success={"rubric": RUBRIC}), llm=llm)
    assert judgement.to_status == "escalated"
    assert judgement.verdict["offline"] is True and judgement.verdict["score"] == 0.0
    assert judgement.error is not None and "offline backend" in judgement.error


def test_a_rubric_without_a_model_escalates() -> None:
    judgement = judge(row({"prices": [1]}, success={"rubric": RUBRIC}), llm=None)
    assert judgement.to_status == "escalated"
    assert judgement.error == "judge: the rubric needs a model and none was available"


def test_an_unreachable_model_escalates_with_the_reason() -> None:
    llm = ScriptedLLM(raises=TransientModelError("connection refused"))
    judgement = judge(row({"prices": [1]}, success={"rubric": RUBRIC}), llm=llm)
    assert judgement.to_status == "escalated"
    assert judgement.error is not None and "connection refused" in judgement.error


def test_a_model_without_a_price_is_the_model_price_rule() -> None:
    llm = ScriptedLLM(raises=UnknownPrice("no price for 'big:70b'"))
    judgement = judge(row({"prices": [1]}, success={"rubric": RUBRIC}), llm=llm)
    assert judgement.to_status == "escalated"
    assert judgement.error is not None and judgement.error.startswith("policy model_price:")


def test_a_lost_lease_propagates_so_the_worker_drops_the_task() -> None:
    with pytest.raises(LeaseLost):
        judge(row({"prices": [1]}, success={"rubric": RUBRIC}),
              llm=ScriptedLLM(raises=LeaseLost("reaped")))


def test_an_answer_outside_the_schema_counts_as_uncertain() -> None:
    judgement = judge(row({"prices": [1]}, success={"rubric": RUBRIC}),
                      llm=ScriptedLLM({"score": 7, "passed": True}))
    assert judgement.to_status == "escalated"
    assert any("did not fit the schema" in r for r in judgement.verdict["reasons"])


def test_a_pydantic_answer_is_accepted() -> None:
    llm = ScriptedLLM(JudgeOutput(score=0.95, passed=True, reasons=["good"]))
    judgement = judge(row({"prices": [1]}, success={"rubric": RUBRIC}), llm=llm)
    assert judgement.to_status == "done"


def test_failing_checks_never_call_the_model() -> None:
    llm = ScriptedLLM(answer(1.0))
    success = {"checks": [{"path": "prices", "op": "len>=", "value": 5}], "rubric": RUBRIC}
    judgement = judge(row({"prices": [1]}, success=success), llm=llm)
    assert judgement.to_status == "failed"
    assert llm.prompts == []


def test_a_dollar_sign_in_the_result_reaches_the_prompt_intact() -> None:
    llm = ScriptedLLM(answer(0.9))
    judge(row({"price": "$100 ${x} $$"}, success={"rubric": RUBRIC}), llm=llm)
    assert "$100 ${x} $$" in llm.prompts[0]


def test_the_judge_prompt_renders_with_every_variable() -> None:
    text = render_prompt("judge", rubric="R", goal="G", threshold="0.7", result="{}")
    assert "R" in text and "0.7" in text and "$" not in text.replace("$$", "")


# ---------------------------------------------------------------------- the judge agent
def test_the_judge_agent_scores_its_payload() -> None:
    task_id = uuid.uuid4()
    task = TaskView(id=task_id, root_id=task_id, parent_id=None, agent="judge", type="judge",
                    payload={"result": {"a": 1}, "rubric": "Is a one?", "threshold": 0.5},
                    depth=0, priority=5, budget_tokens=1000, budget_seconds=60,
                    budget_usd=Decimal("1"))
    llm = ScriptedLLM(answer(0.6))
    ctx = AgentContext(llm=llm, task=task, log=logging.getLogger("test"))
    outcome = Judge().run(ctx, task)
    assert isinstance(outcome, Result)
    assert outcome.output == {"score": 0.6, "passed": True, "reasons": ["cites two sources"],
                              "uncertain": False}
    assert "Is a one?" in llm.prompts[0]


def test_score_rubric_decides_passed_from_the_threshold() -> None:
    scored = score_rubric(ScriptedLLM({"score": 0.2, "passed": True}), rubric="r",
                          result={}, threshold=0.5)
    assert scored.passed is False and scored.model == "judge-model:1b"
