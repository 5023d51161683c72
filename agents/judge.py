"""The built-in ``judge`` agent: scores a result against a rubric with one model call.

The judge stage (``runtime.engine.judge_stage``) calls :func:`score_rubric` when a task's
``success_criteria`` holds a rubric; the agent itself can also be delegated to like any
other (payload :class:`JudgeInput`, result :class:`JudgeOutput`). The model answers in
the :class:`JudgeOutput` schema; an answer that does not fit it counts as uncertain, and
an uncertain judge sends the task to a person rather than guessing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.base import Agent, Result
from agents.context import PROMPTS_DIR, render_prompt

if TYPE_CHECKING:
    from agents.base import TaskView
    from agents.context import LLM, AgentContext

#: The rubric used when a judge task names none.
DEFAULT_RUBRIC = "The result answers the goal correctly, completely and usefully."
#: The longest result text put in the judge's prompt; the rest is cut and marked.
MAX_RESULT_CHARS = 12_000
OFFLINE_REASON = (
    "offline backend: no model answered, so the rubric was not scored; a person must judge"
)
JUDGE_SYSTEM = (
    "You are a strict, fair evaluator. Answer only in the requested JSON schema. "
    "Set uncertain to true when you cannot tell."
)


class JudgeInput(BaseModel):
    """What the judge scores: a result, the rubric, the goal it served, the pass mark."""

    model_config = ConfigDict(extra="allow")

    result: Any = None
    rubric: str = DEFAULT_RUBRIC
    goal: str = ""
    threshold: float = Field(0.7, ge=0, le=1)


class JudgeOutput(BaseModel):
    """The judge's answer."""

    score: float = Field(ge=0, le=1, description="How well the result meets the rubric, 0..1")
    passed: bool = Field(description="Whether the result meets the rubric")
    reasons: list[str] = Field(default_factory=list, description="Short reasons for the score")
    uncertain: bool = Field(False, description="True when the judge cannot tell")


@dataclass(frozen=True)
class RubricScore:
    """A scored rubric: the model's answer (validated) and which model gave it."""

    score: float
    passed: bool
    reasons: list[str] = field(default_factory=list)
    uncertain: bool = False
    model: str = "unknown"
    offline: bool = False


def result_text(result: Any, limit: int = MAX_RESULT_CHARS) -> str:
    """Return the result as indented JSON, cut to ``limit`` characters with a marker."""
    text = json.dumps(result, indent=2, ensure_ascii=False, default=str)
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [cut: {len(text) - limit} more characters]"


def _answer_data(completion: Any) -> Any:
    data = getattr(completion, "data", None)
    if data is None and isinstance(getattr(completion, "text", None), str):
        try:
            data = json.loads(completion.text)
        except ValueError:
            return None
    if isinstance(data, BaseModel):
        return data.model_dump()
    return data


_M = TypeVar("_M", bound=BaseModel)


def _fitted(schema: type[_M], completion: Any) -> tuple[_M | None, str]:
    """The model's answer as ``schema``, or None and why it did not fit."""
    output = getattr(completion, "output", None)
    if isinstance(output, schema):  # validated once, by the model layer
        return output, ""
    try:
        return schema.model_validate(_answer_data(completion)), ""
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        return None, f"the judge's answer did not fit the schema: {where}: {first['msg']}"


def score_rubric(llm: LLM, *, rubric: str, result: Any, goal: str = "",
                 threshold: float = 0.7, prompts_dir: Path = PROMPTS_DIR) -> RubricScore:
    """Ask the model to score ``result`` against ``rubric``.

    ``passed`` is decided here, as ``score >= threshold``, not by the model's own flag.
    An answer that does not fit :class:`JudgeOutput` comes back uncertain, and so does an
    answer from the offline backend: a hash of the prompt is not a judgement.

    Args:
        llm: a ``ctx.llm``-like object (``complete(prompt, schema=..., system=...)``).
        rubric: what a good result looks like.
        result: the result to score (JSON values).
        goal: the task's goal, for context.
        threshold: the pass mark, 0..1.
        prompts_dir: where ``judge.md`` lives.

    Raises:
        Whatever ``llm.complete`` raises (model unavailable, budget, unknown price).

    """
    prompt = render_prompt(
        "judge", prompts_dir,
        rubric=rubric.strip(), goal=goal.strip() or "(not stated)",
        threshold=f"{threshold:g}", result=result_text(result),
    )
    completion = llm.complete(prompt, schema=JudgeOutput, system=JUDGE_SYSTEM)
    model = str(getattr(completion, "model", None) or "unknown")
    if getattr(completion, "offline", False):
        return RubricScore(0.0, False, [OFFLINE_REASON], True, model, offline=True)
    answer, misfit = _fitted(JudgeOutput, completion)
    if answer is None:
        return RubricScore(0.0, False, [misfit], True, model)
    return RubricScore(answer.score, answer.score >= threshold, list(answer.reasons),
                       answer.uncertain, model)


class Judge(Agent):
    """Scores a result against a rubric (the judge stage uses it for rubrics)."""

    name = "judge"
    types = ("judge",)
    description = "Scores a result against a rubric with one model call."
    input_model = JudgeInput
    output_model = JudgeOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        """Score the payload's result against its rubric."""
        given = task.input if isinstance(task.input, JudgeInput) else None
        judge_input = given or JudgeInput.model_validate(task.payload)
        scored = score_rubric(
            ctx.llm, rubric=judge_input.rubric, result=judge_input.result,
            goal=judge_input.goal, threshold=judge_input.threshold,
            prompts_dir=ctx.prompts_dir,
        )
        return Result(JudgeOutput(score=scored.score, passed=scored.passed,
                                  reasons=scored.reasons,
                                  uncertain=scored.uncertain).model_dump())


# --------------------------------------------------------------------------- pairwise
PAIRWISE_SYSTEM = (
    "You are a strict, fair evaluator comparing two answers to one goal. Answer only in "
    "the requested JSON schema. Set uncertain to true when you cannot tell."
)


class PairwiseInput(BaseModel):
    """Two answers to one goal, in the order they are shown, and what makes one better."""

    model_config = ConfigDict(extra="forbid")

    goal: str = ""
    rubric: str = DEFAULT_RUBRIC
    first: Any = None
    second: Any = None


class PairwiseOutput(BaseModel):
    """Which answer is better: ``first``, ``second`` or ``tie``."""

    preferred: str = Field(pattern="^(first|second|tie)$",
                           description="The better answer: first, second, or tie")
    reasons: list[str] = Field(default_factory=list, description="Short reasons")
    uncertain: bool = Field(False, description="True when the judge cannot tell")


class PairwiseJudge(Agent):
    """Compares two answers to one goal (an experiment's pairwise scorer submits these).

    The order the answers are shown in is chosen by the caller (at random, and recorded),
    since a model judge tends to favour one position. An answer that does not fit
    :class:`PairwiseOutput`, or one from the offline backend, comes back uncertain.
    """

    name = "pairwise_judge"
    types = ("judge",)
    description = "Says which of two answers to one goal is better, with one model call."
    input_model = PairwiseInput
    output_model = PairwiseOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        """Ask the model which answer is better."""
        given = task.input if isinstance(task.input, PairwiseInput) else None
        pair = given or PairwiseInput.model_validate(task.payload)
        prompt = ctx.prompt(self.name, goal=pair.goal.strip() or "(not stated)",
                            rubric=pair.rubric.strip(), first=result_text(pair.first),
                            second=result_text(pair.second))
        completion = ctx.llm.complete(prompt, schema=PairwiseOutput, system=PAIRWISE_SYSTEM)
        if getattr(completion, "offline", False):
            return Result(PairwiseOutput(preferred="tie", reasons=[OFFLINE_REASON],
                                         uncertain=True).model_dump())
        answer, misfit = _fitted(PairwiseOutput, completion)
        if answer is None:
            answer = PairwiseOutput(preferred="tie", uncertain=True, reasons=[misfit])
        return Result(answer.model_dump())
