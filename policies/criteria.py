"""``success_criteria`` and ``kill_criteria``: their shape, validation, and the simple checks.

``success_criteria`` (every key optional)::

    {"schema": {...a JSON Schema the result must match...},
     "checks": [{"path": "items.0.score", "op": ">=", "value": 0.5}, ...],
     "rubric": {"text": "Is the summary faithful to the sources?", "threshold": 0.7}}

A check's ``path`` is dot-separated keys and list indexes into the result (``""`` or
``"$"`` is the whole result; a leading ``"$."`` is allowed). Operators: ``==``, ``!=``,
``>``, ``>=``, ``<``, ``<=`` (numbers with numbers, strings with strings), ``contains``
(substring, list element or object key), ``len>=``, ``len<=`` (strings, lists, objects),
``exists`` (``value`` true by default; false means the path must be absent) and
``matches`` (a regular expression searched in a string).

``kill_criteria`` (every key optional): ``max_cost_usd``, ``max_tokens`` (tree-wide
spend), ``max_seconds`` (time workers spent on the task), ``max_child_failures``
(children ending failed or escalated), ``deadline`` (ISO-8601; a time without a zone is
UTC). A limit is hit when the figure goes beyond it.

:func:`validate_criteria` refuses malformed criteria at submission with
:class:`runtime.errors.BadInput`, naming the key and suggesting the closest valid one.
"""

from __future__ import annotations

import datetime as dt
import difflib
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from runtime.errors import BadInput

SUCCESS_KEYS = ("schema", "checks", "rubric")
KILL_KEYS = ("max_cost_usd", "max_tokens", "max_seconds", "max_child_failures", "deadline")
CHECK_KEYS = ("path", "op", "value")
RUBRIC_KEYS = ("text", "threshold")
COMPARISONS = ("==", "!=", ">", ">=", "<", "<=")
OPERATORS = (*COMPARISONS, "contains", "len>=", "len<=", "exists", "matches")
DEFAULT_THRESHOLD = 0.7
#: What :func:`resolve_path` returns for a path absent from the result.
MISSING: Any = object()


#: Spellings of operators people reach for, mapped to orgchart's.
OPERATOR_ALIASES = {"=": "==", "eq": "==", "ne": "!=", "<>": "!=", "gt": ">", "ge": ">=",
                    "gte": ">=", "lt": "<", "le": "<=", "lte": "<=", "in": "contains",
                    "has": "contains", "regex": "matches", "re": "matches", "match": "matches"}


def _hint(word: str, choices: tuple[str, ...]) -> str:
    if choices is OPERATORS:
        squeezed = word.lower().replace(" ", "")
        alias = OPERATOR_ALIASES.get(squeezed) or next(
            (op for op in OPERATORS if sorted(op) == sorted(squeezed)), None)
        if alias:
            return f"; did you mean {alias!r}?"
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f" (valid: {', '.join(choices)})"


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float | Decimal) and not isinstance(value, bool)
            and math.isfinite(value))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_keys(where: str, body: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadInput(f"{where} must be a JSON object, not {type(body).__name__}")
    for key in body:
        if key not in allowed:
            raise BadInput(f"{where}: unknown key {key!r}{_hint(str(key), allowed)}")
    return body


def parse_deadline(value: Any) -> dt.datetime:
    """Parse an ISO-8601 deadline (a time without a zone is UTC).

    Raises:
        BadInput: not a string in ISO-8601 form.

    """
    if not isinstance(value, str):
        raise BadInput(f"kill_criteria.deadline must be an ISO-8601 string, not {value!r}")
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(
            f"kill_criteria.deadline {value!r} is not an ISO-8601 date-time "
            "(for example 2026-12-01T18:00:00Z)"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def _validate_check(where: str, check: Any) -> None:
    body = _check_keys(where, check, CHECK_KEYS)
    for key in ("path", "op"):
        if key not in body:
            raise BadInput(f"{where}: missing {key!r}")
    if not isinstance(body["path"], str):
        raise BadInput(f"{where}.path must be a string like 'items.0.score'")
    op = body["op"]
    if op not in OPERATORS:
        raise BadInput(f"{where}.op: unknown operator {op!r}{_hint(str(op), OPERATORS)}")
    value = body.get("value", MISSING)
    if op == "exists":
        if value is not MISSING and not isinstance(value, bool):
            raise BadInput(f"{where}.value: 'exists' takes true or false, not {value!r}")
        return
    if value is MISSING:
        raise BadInput(f"{where}: operator {op!r} needs a 'value'")
    if op in ("len>=", "len<="):
        if not _is_count(value):
            raise BadInput(f"{where}.value: {op!r} needs a non-negative integer, not {value!r}")
    elif op in (">", ">=", "<", "<="):
        if not (_is_number(value) or isinstance(value, str)):
            raise BadInput(f"{where}.value: {op!r} needs a number or a string, not {value!r}")
    elif op == "matches":
        if not isinstance(value, str):
            raise BadInput(f"{where}.value: 'matches' needs a regular expression string")
        try:
            re.compile(value)
        except re.error as exc:
            raise BadInput(
                f"{where}.value: {value!r} is not a valid regular expression: {exc}"
            ) from None


def _validate_success(success: Any) -> None:
    body = _check_keys("success_criteria", success, SUCCESS_KEYS)
    if "schema" in body:
        schema = body["schema"]
        if not isinstance(schema, dict | bool):
            raise BadInput("success_criteria.schema must be a JSON Schema object")
        import jsonschema  # on first use: most start-ups check no schema

        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
            raise BadInput(
                f"success_criteria.schema is not a valid JSON Schema at {where}: {exc.message}"
            ) from None
    if "checks" in body:
        checks = body["checks"]
        if not isinstance(checks, list):
            raise BadInput("success_criteria.checks must be a list of {path, op, value}")
        for index, check in enumerate(checks):
            _validate_check(f"success_criteria.checks[{index}]", check)
    if "rubric" in body:
        rubric = _check_keys("success_criteria.rubric", body["rubric"], RUBRIC_KEYS)
        text = rubric.get("text")
        if not isinstance(text, str) or not text.strip():
            raise BadInput("success_criteria.rubric.text must be a non-empty string")
        threshold = rubric.get("threshold", DEFAULT_THRESHOLD)
        if not _is_number(threshold) or not 0 <= threshold <= 1:
            raise BadInput(
                f"success_criteria.rubric.threshold must be a number from 0 to 1, not {threshold!r}"
            )


def _validate_kill(kill: Any) -> None:
    body = _check_keys("kill_criteria", kill, KILL_KEYS)
    for key in ("max_cost_usd", "max_seconds"):
        if key in body and not (_is_number(body[key]) and body[key] >= 0):
            raise BadInput(f"kill_criteria.{key} must be a number >= 0, not {body[key]!r}")
    for key in ("max_tokens", "max_child_failures"):
        if key in body and not _is_count(body[key]):
            raise BadInput(f"kill_criteria.{key} must be an integer >= 0, not {body[key]!r}")
    if "deadline" in body:
        parse_deadline(body["deadline"])


def validate_criteria(success: Any, kill: Any) -> None:
    """Refuse malformed criteria before anything is written.

    Args:
        success: ``success_criteria`` (a dict or None).
        kill: ``kill_criteria`` (a dict or None).

    Raises:
        BadInput: unknown keys (with the closest valid one), a bad operator, a schema that
            is not a valid JSON Schema, a bad rubric, a deadline not in ISO-8601, a negative
            or non-numeric limit. The message names the offending key.

    """
    if success is not None:
        _validate_success(success)
    if kill is not None:
        _validate_kill(kill)


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check, as stored in the verdict."""

    path: str
    op: str
    value: Any
    passed: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        """Return the JSON form kept in ``verdict.checks``."""
        return {"path": self.path, "op": self.op, "value": self.value,
                "passed": self.passed, "detail": self.detail}


def resolve_path(value: Any, path: str) -> Any:
    """Follow a dot path into a JSON value; return the sentinel ``MISSING`` when absent."""
    path = path[1:] if path.startswith("$") else path
    path = path.removeprefix(".")
    if not path:
        return value
    current = value
    for part in path.split("."):
        if isinstance(current, dict) and part in current:
            current = current[part]
        elif isinstance(current, list) and re.fullmatch(r"-?\d+", part):
            index = int(part)
            if not -len(current) <= index < len(current):
                return MISSING
            current = current[index]
        else:
            return MISSING
    return current



def _json_equal(a: Any, b: Any) -> bool:
    # JSON has no 1 == true: keep booleans apart from numbers.
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return bool(a == b)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _compare(op: str, actual: Any, expected: Any) -> tuple[bool, str]:
    same_kind = (_is_number(actual) and _is_number(expected)) or (
        isinstance(actual, str) and isinstance(expected, str))
    if not same_kind:
        return False, f"{_short(actual)} cannot be compared with {_short(expected)}"
    passed = {
        ">": actual > expected, ">=": actual >= expected,
        "<": actual < expected, "<=": actual <= expected,
    }[op]
    return passed, f"{_short(actual)} {op} {_short(expected)}"


def _evaluate(op: str, actual: Any, expected: Any) -> tuple[bool, str]:
    if op == "==":
        return _json_equal(actual, expected), f"got {_short(actual)}"
    if op == "!=":
        return not _json_equal(actual, expected), f"got {_short(actual)}"
    if op in (">", ">=", "<", "<="):
        return _compare(op, actual, expected)
    if op == "contains":
        if isinstance(actual, str):
            found = isinstance(expected, str) and expected in actual
        elif isinstance(actual, list):
            found = any(_json_equal(item, expected) for item in actual)
        elif isinstance(actual, dict):
            found = isinstance(expected, str) and expected in actual
        else:
            return False, f"{_short(actual)} is not a string, list or object"
        return found, ("contains" if found else "does not contain") + f" {_short(expected)}"
    if op in ("len>=", "len<="):
        if not isinstance(actual, str | list | dict):
            return False, f"{_short(actual)} has no length"
        size = len(actual)
        return (size >= expected if op == "len>=" else size <= expected), f"length {size}"
    if op == "matches":
        if not isinstance(actual, str):
            return False, f"{_short(actual)} is not a string"
        found = re.search(expected, actual) is not None
        return found, "matches" if found else f"{_short(actual)} does not match"
    raise BadInput(f"unknown operator {op!r}")


def run_check(result: Any, check: dict[str, Any]) -> CheckResult:
    """Evaluate one (already validated) check against a result."""
    path, op = check["path"], check["op"]
    expected = check.get("value", True if op == "exists" else None)
    actual = resolve_path(result, path)
    if op == "exists":
        present = actual is not MISSING
        return CheckResult(path, op, expected, present == expected,
                           "present" if present else "absent")
    if actual is MISSING:
        return CheckResult(path, op, expected, False, f"path {path!r} not found in the result")
    passed, detail = _evaluate(op, actual, expected)
    return CheckResult(path, op, expected, passed, detail)
