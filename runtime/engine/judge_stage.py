"""The judge stage: turns a ``judging`` task's result into a verdict and a final status.

:func:`judge_task` is pure over the task row, its children's rows and a model handle;
the worker claims the task, calls it and writes the :class:`Judgement` in one guarded
transition. The order:

1. ``kill_criteria`` (cost, tokens, seconds, child failures, deadline): any limit hit
   -> ``escalated``; the reasons name each limit and the figures.
2. ``success_criteria.schema`` and ``checks``: any miss -> ``failed``; no model is
   called for a result that already failed the rules.
3. ``success_criteria.rubric``: one call to the ``judge`` agent's model; a score at or
   above the threshold -> ``done``, below -> ``failed``. An uncertain judge, a model that
   cannot be reached, an answer from the offline backend (a hash of the prompt is not a
   judgement), or no model handle -> ``escalated`` (a person decides).

No criteria at all -> ``done``: the result was already checked by the output policies.
The verdict (stored in ``tasks.verdict``) is ``{"passed", "score", "reasons", "judge",
"checks"}`` plus ``"kill"`` when a limit was hit; ``judge`` is ``"rules"`` or the model.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from agents.judge import score_rubric
from policies.builtin import json_path, schema_validator
from policies.criteria import DEFAULT_THRESHOLD, parse_deadline, run_check, validate_criteria
from runtime.budget import spend_hits
from runtime.errors import BadInput, LeaseLost, UnknownPrice

if TYPE_CHECKING:
    from runtime.config import Settings

#: Statuses of children that count as failures for ``max_child_failures``.
FAILED_CHILD_STATUSES = ("failed", "escalated", "cancelled")
#: How many schema errors a verdict lists.
MAX_SCHEMA_ERRORS = 3


@dataclass(frozen=True)
class Judgement:
    """What the judge decided: the final status, the verdict to store, the error text."""

    to_status: str
    verdict: dict[str, Any]
    error: str | None = None


def _verdict(passed: bool, score: float, reasons: list[str], judge: str = "rules",
             checks: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"passed": passed, "score": round(float(score), 4), "reasons": reasons,
            "judge": judge, "checks": checks or [], **extra}


def undecided(reason: str) -> dict[str, Any]:
    """The verdict stored when none could be reached: not passed, score 0, the reason.

    The judge raised, or the outcome it decided could not be stored; the task is
    escalated (or failed) with this verdict, by the rules judge's name.
    """
    return _verdict(False, 0.0, [reason])


def accepted() -> Judgement:
    """What the rules judge says of a task with no success criteria and no kill criteria."""
    return Judgement("done", _verdict(True, 1.0, ["no success criteria: accepted"]))


def _money(value: Any) -> Decimal:
    return Decimal(str(value)) if value is not None else Decimal(0)


def _aware(value: Any) -> dt.datetime | None:
    if not isinstance(value, dt.datetime):
        return None
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def kill_hits(task: dict[str, Any], children: list[dict[str, Any]],
              now: dt.datetime) -> list[dict[str, Any]]:
    """Return every kill criterion the task has hit, each with its limit and figure."""
    kill = task.get("kill_criteria") or {}
    # Spend limits are budget rule 7 (runtime.budget.spend_hits).
    hits = spend_hits(int(task.get("spent_tokens") or 0), _money(task.get("spent_usd")), kill)

    def hit(name: str, limit: Any, actual: Any, reason: str) -> None:
        hits.append({"criterion": name, "limit": limit, "actual": actual, "reason": reason})

    if "max_seconds" in kill:
        seconds = float(task.get("duration_seconds") or 0.0)
        if seconds > kill["max_seconds"]:
            hit("max_seconds", kill["max_seconds"], round(seconds, 3),
                f"max_seconds: worked {seconds:.1f} s > limit {kill['max_seconds']} s")
    if "max_child_failures" in kill:
        failed = [c for c in children if c.get("status") in FAILED_CHILD_STATUSES]
        if len(failed) > kill["max_child_failures"]:
            hit("max_child_failures", kill["max_child_failures"], len(failed),
                f"max_child_failures: {len(failed)} of {len(children)} children failed or "
                f"escalated > limit {kill['max_child_failures']}")
    if "deadline" in kill:
        deadline = parse_deadline(kill["deadline"])
        if now > deadline:
            hit("deadline", kill["deadline"], now.isoformat(),
                f"deadline: judged at {now.isoformat(timespec='seconds')}, after the deadline "
                f"{deadline.isoformat(timespec='seconds')}")
    return hits


def _schema_errors(schema: Any, result: Any) -> list[str]:
    validator = schema_validator(schema)
    errors = sorted(validator.iter_errors(result), key=lambda e: list(e.absolute_path))
    return [f"{json_path(e.absolute_path)}: {e.message[:200]}" for e in errors]


def _goal(task: dict[str, Any]) -> str:
    payload = task.get("payload")
    if isinstance(payload, dict) and isinstance(payload.get("goal"), str):
        return payload["goal"]
    return json.dumps(payload, ensure_ascii=False, default=str)[:2000]


def _rubric(task: dict[str, Any], rubric: dict[str, Any], llm: Any | None, score: float,
            reasons: list[str], checks: list[dict[str, Any]]) -> Judgement:
    threshold = float(rubric.get("threshold", DEFAULT_THRESHOLD))
    if llm is None:
        why = "the rubric needs a model and none was available"
        return Judgement("escalated", _verdict(False, score, [*reasons, why], checks=checks),
                         f"judge: {why}")
    try:
        scored = score_rubric(llm, rubric=rubric["text"], result=task.get("result"),
                              goal=_goal(task), threshold=threshold)
    except LeaseLost:
        raise
    except UnknownPrice as exc:
        why = f"the judge's model has no price: {exc}"
        return Judgement("escalated", _verdict(False, score, [*reasons, why], checks=checks),
                         f"policy {UnknownPrice.rule}: {exc}")
    except Exception as exc:
        why = f"the judge's model could not score the rubric: {type(exc).__name__}: {exc}"
        return Judgement("escalated", _verdict(False, score, [*reasons, why], checks=checks),
                         f"judge: {why}")
    mark = f"rubric score {scored.score:g} (threshold {threshold:g})"
    all_reasons = [*reasons, mark, *scored.reasons]
    if scored.offline:
        return Judgement(
            "escalated",
            _verdict(False, 0.0, [*reasons, *scored.reasons], scored.model, checks,
                     uncertain=True, offline=True),
            "judge: the rubric was not scored: the offline backend answered, not a model",
        )
    if scored.uncertain:
        return Judgement(
            "escalated",
            _verdict(False, scored.score, [*all_reasons, "the judge was uncertain"],
                     scored.model, checks, uncertain=True),
            f"judge: uncertain about the rubric ({mark})",
        )
    verdict = _verdict(scored.passed, scored.score, all_reasons, scored.model, checks)
    if scored.passed:
        return Judgement("done", verdict)
    return Judgement("failed", verdict, f"judge: {mark} is below the threshold")


def _rules(success: dict[str, Any], result: Any
           ) -> tuple[Judgement | None, float, list[str], list[dict[str, Any]]]:
    """Check ``result`` against the schema and the checks.

    Returns a failed judgement (None when every rule passed), the score, the reasons and
    the checks' records.
    """
    reasons: list[str] = []
    passed_rules = total_rules = 0
    if "schema" in success:
        total_rules += 1
        errors = _schema_errors(success["schema"], result)
        if errors:
            listed = errors[:MAX_SCHEMA_ERRORS]
            more = len(errors) - len(listed)
            reasons.append("the result does not match success_criteria.schema: "
                           + "; ".join(listed) + (f" (and {more} more)" if more else ""))
        else:
            passed_rules += 1
            reasons.append("the result matches success_criteria.schema")
    checks = [run_check(result, c).as_dict() for c in success.get("checks") or []]
    total_rules += len(checks)
    passed_rules += sum(1 for c in checks if c["passed"])
    for c in checks:
        if not c["passed"]:
            reasons.append(f"check failed: {c['path'] or '$'} {c['op']} "
                           f"{json.dumps(c['value'], default=str)} ({c['detail']})")
    score = passed_rules / total_rules if total_rules else 1.0
    if passed_rules < total_rules:
        failed = [r for r in reasons if not r.startswith("the result matches")]
        return (Judgement("failed", _verdict(False, score, reasons, checks=checks),
                          "judge: " + "; ".join(failed)), score, reasons, checks)
    if checks:
        reasons.append(f"all {len(checks)} checks passed")
    return None, score, reasons, checks


def judge_task(task: dict[str, Any], children: list[dict[str, Any]], llm: Any | None,
               settings: Settings, *, now: dt.datetime | None = None) -> Judgement:
    """Judge one task: kill criteria, then schema and checks, then the rubric.

    Args:
        task: the ``tasks`` row (``result``, criteria, spend, ``duration_seconds``...).
        children: the task's children rows (for ``max_child_failures``).
        llm: a ``ctx.llm``-like handle for the rubric, or None.
        settings: the configuration (reserved for judge settings).
        now: the time deadlines are judged against (defaults to the current time).

    Returns:
        The final status, the verdict to store and the error text (None when done).

    """
    now = _aware(now) or dt.datetime.now(dt.UTC)
    success = task.get("success_criteria") or {}
    try:
        # Criteria are checked at submission; rows written another way are checked here.
        validate_criteria(task.get("success_criteria"), task.get("kill_criteria"))
    except BadInput as exc:
        why = f"malformed criteria: {exc}"
        return Judgement("escalated", _verdict(False, 0.0, [why]), f"judge: {why}")
    hits = kill_hits(task, children, now)
    if hits:
        killed = [h["reason"] for h in hits]
        return Judgement("escalated", _verdict(False, 0.0, killed, kill=hits),
                         "kill criteria: " + "; ".join(killed))
    if not success:
        return accepted()

    result = task.get("result")
    failed, score, reasons, checks = _rules(success, result)
    if failed is not None:
        return failed
    if "rubric" in success:
        return _rubric(task, success["rubric"], llm, score, reasons, checks)
    return Judgement("done", _verdict(True, 1.0, reasons, checks=checks))
