"""success_criteria / kill_criteria: validation at submission and the simple checks."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.criteria import (
    KILL_KEYS,
    MISSING,
    OPERATORS,
    SUCCESS_KEYS,
    parse_deadline,
    resolve_path,
    run_check,
    validate_criteria,
)
from runtime.errors import BadInput

VALID_SUCCESS: list[Any] = [
    None,
    {},
    {"schema": {"type": "object", "required": ["text"]}},
    {"schema": True},
    {"checks": []},
    {"checks": [{"path": "items", "op": "len>=", "value": 3}]},
    {"checks": [{"path": "a.b.0", "op": "==", "value": {"x": [1, None]}}]},
    {"checks": [{"path": "score", "op": ">=", "value": 0.5},
                {"path": "name", "op": "<", "value": "m"},
                {"path": "tags", "op": "contains", "value": "ai"},
                {"path": "summary", "op": "matches", "value": r"^\w+"},
                {"path": "draft", "op": "exists", "value": False},
                {"path": "text", "op": "exists"},
                {"path": "text", "op": "len<=", "value": 0},
                {"path": "$", "op": "!=", "value": None}]},
    {"rubric": {"text": "Is it faithful to the sources?"}},
    {"rubric": {"text": "Good?", "threshold": 0}},
    {"rubric": {"text": "Good?", "threshold": 1}},
    {"schema": {"type": "object"}, "checks": [{"path": "x", "op": "exists"}],
     "rubric": {"text": "ok", "threshold": 0.8}},
]

VALID_KILL: list[Any] = [
    None,
    {},
    {"max_cost_usd": 0.5},
    {"max_cost_usd": 0, "max_tokens": 0, "max_seconds": 0, "max_child_failures": 0},
    {"max_tokens": 10_000, "max_seconds": 12.5, "max_child_failures": 2},
    {"deadline": "2026-12-01T18:00:00Z"},
    {"deadline": "2026-12-01T18:00:00+02:00"},
    {"deadline": "2026-12-01"},
]


@pytest.mark.parametrize("success", VALID_SUCCESS)
def test_valid_success_criteria_are_accepted(success: Any) -> None:
    validate_criteria(success, None)


@pytest.mark.parametrize("kill", VALID_KILL)
def test_valid_kill_criteria_are_accepted(kill: Any) -> None:
    validate_criteria(None, kill)


MALFORMED: list[tuple[Any, Any, str]] = [
    ("not a dict", None, "success_criteria must be a JSON object"),
    (["schema"], None, "success_criteria must be a JSON object"),
    (None, 5, "kill_criteria must be a JSON object"),
    ({"shema": {}}, None, "unknown key 'shema'; did you mean 'schema'?"),
    ({"check": []}, None, "did you mean 'checks'?"),
    (None, {"max_cost": 1}, "unknown key 'max_cost'; did you mean 'max_cost_usd'?"),
    (None, {"max_token": 1}, "did you mean 'max_tokens'?"),
    ({"schema": "object"}, None, "must be a JSON Schema object"),
    ({"schema": {"type": "objekt"}}, None, "not a valid JSON Schema"),
    ({"schema": {"type": "object", "required": "text"}}, None, "not a valid JSON Schema"),
    ({"schema": {"properties": {"a": {"minLength": -1}}}}, None, "properties/a/minLength"),
    ({"checks": {"path": "a"}}, None, "checks must be a list"),
    ({"checks": ["a == 1"]}, None, "checks[0] must be a JSON object"),
    ({"checks": [{"op": "==", "value": 1}]}, None, "checks[0]: missing 'path'"),
    ({"checks": [{"path": "a", "value": 1}]}, None, "missing 'op'"),
    ({"checks": [{"path": 3, "op": "==", "value": 1}]}, None, "path must be a string"),
    ({"checks": [{"path": "a", "op": "=>", "value": 1}]}, None,
     "unknown operator '=>'; did you mean '>='?"),
    ({"checks": [{"path": "a", "op": "equals", "value": 1}]}, None, "unknown operator"),
    ({"checks": [{"path": "a", "op": "==", "value": 1, "note": "x"}]}, None,
     "checks[0]: unknown key 'note'"),
    ({"checks": [{"path": "a", "op": "=="}]}, None, "operator '==' needs a 'value'"),
    ({"checks": [{"path": "a", "op": ">", "value": [1]}]}, None, "needs a number or a string"),
    ({"checks": [{"path": "a", "op": ">", "value": True}]}, None, "needs a number or a string"),
    ({"checks": [{"path": "a", "op": "len>=", "value": -1}]}, None, "non-negative integer"),
    ({"checks": [{"path": "a", "op": "len<=", "value": 1.5}]}, None, "non-negative integer"),
    ({"checks": [{"path": "a", "op": "matches", "value": "("}]}, None,
     "not a valid regular expression"),
    ({"checks": [{"path": "a", "op": "matches", "value": 3}]}, None, "regular expression"),
    ({"checks": [{"path": "a", "op": "exists", "value": "yes"}]}, None, "true or false"),
    ({"checks": [{"path": "a", "op": "==", "value": 1}, {"path": "b", "op": "~"}]}, None,
     "checks[1].op"),
    ({"rubric": "be good"}, None, "rubric must be a JSON object"),
    ({"rubric": {"text": ""}}, None, "rubric.text must be a non-empty string"),
    ({"rubric": {"threshold": 0.5}}, None, "rubric.text"),
    ({"rubric": {"text": "ok", "threshold": 1.5}}, None, "threshold must be a number from 0 to 1"),
    ({"rubric": {"text": "ok", "threshold": "high"}}, None, "threshold"),
    ({"rubric": {"text": "ok", "treshold": 0.5}}, None, "did you mean 'threshold'?"),
    (None, {"max_cost_usd": -0.01}, "max_cost_usd must be a number >= 0"),
    (None, {"max_cost_usd": "1"}, "max_cost_usd must be a number"),
    (None, {"max_cost_usd": float("nan")}, "max_cost_usd must be a number"),
    (None, {"max_seconds": float("inf")}, "max_seconds must be a number"),
    (None, {"max_tokens": -1}, "max_tokens must be an integer >= 0"),
    (None, {"max_tokens": 10.5}, "max_tokens must be an integer"),
    (None, {"max_child_failures": True}, "max_child_failures must be an integer"),
    (None, {"deadline": "tomorrow"}, "not an ISO-8601 date-time"),
    (None, {"deadline": "2026-13-01T00:00:00Z"}, "not an ISO-8601"),
    (None, {"deadline": 1767225600}, "deadline must be an ISO-8601 string"),
]


@pytest.mark.parametrize(("success", "kill", "message"), MALFORMED)
def test_malformed_criteria_are_refused_with_a_clear_message(success: Any, kill: Any,
                                                             message: str) -> None:
    with pytest.raises(BadInput) as info:
        validate_criteria(success, kill)
    assert message in str(info.value)


# ---------------------------------------------------------------------- hypothesis
json_scalars = (st.none() | st.booleans() | st.integers()
                | st.floats(allow_nan=False, allow_infinity=False) | st.text())
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=4),
    max_leaves=12,
)
paths = st.lists(st.from_regex(r"[a-z]{1,4}|[0-9]", fullmatch=True), max_size=3).map(".".join)


@st.composite
def valid_checks(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from(OPERATORS))
    check: dict[str, Any] = {"path": draw(paths), "op": op}
    if op in ("len>=", "len<="):
        check["value"] = draw(st.integers(min_value=0, max_value=100))
    elif op in (">", ">=", "<", "<="):
        check["value"] = draw(st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                              | st.text())
    elif op == "matches":
        check["value"] = draw(st.sampled_from([r"\d+", "^a", "x|y", ".*"]))
    elif op == "exists":
        if draw(st.booleans()):
            check["value"] = draw(st.booleans())
    else:
        check["value"] = draw(json_values)
    return check


@given(st.lists(valid_checks(), max_size=6), json_values)
@settings(max_examples=150, deadline=None)
def test_generated_valid_checks_are_accepted_and_evaluate_to_a_bool(
        checks: list[dict[str, Any]], result: Any) -> None:
    validate_criteria({"checks": checks}, None)
    for check in checks:
        assert isinstance(run_check(result, check).passed, bool)


@given(st.text(min_size=1).filter(lambda k: k not in SUCCESS_KEYS), json_values)
@settings(max_examples=100, deadline=None)
def test_any_unknown_success_key_is_refused_naming_it(key: str, value: Any) -> None:
    with pytest.raises(BadInput, match="unknown key"):
        validate_criteria({key: value}, None)


@given(st.text(min_size=1).filter(lambda k: k not in KILL_KEYS), json_values)
@settings(max_examples=100, deadline=None)
def test_any_unknown_kill_key_is_refused_naming_it(key: str, value: Any) -> None:
    with pytest.raises(BadInput) as info:
        validate_criteria(None, {key: value})
    assert repr(key) in str(info.value)


@given(st.sampled_from(["max_cost_usd", "max_tokens", "max_seconds", "max_child_failures"]),
       st.integers(max_value=-1) | st.floats(max_value=-1e-9) | st.text() | st.booleans()
       | st.lists(st.integers(), max_size=2))
@settings(max_examples=150, deadline=None)
def test_negative_or_non_numeric_limits_are_refused(key: str, value: Any) -> None:
    with pytest.raises(BadInput, match=key):
        validate_criteria(None, {key: value})


def _is_iso(text: str) -> bool:
    try:
        dt.datetime.fromisoformat(text)
    except ValueError:
        return False
    return True


@given(st.text().filter(lambda t: not _is_iso(t)))
@settings(max_examples=100, deadline=None)
def test_deadlines_that_are_not_iso_8601_are_refused(text: str) -> None:
    with pytest.raises(BadInput, match="deadline"):
        validate_criteria(None, {"deadline": text})


@given(st.text(min_size=1, max_size=6).filter(lambda op: op not in OPERATORS))
@settings(max_examples=100, deadline=None)
def test_unknown_operators_are_refused(op: str) -> None:
    with pytest.raises(BadInput, match="unknown operator"):
        validate_criteria({"checks": [{"path": "a", "op": op, "value": 1}]}, None)


@given(st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), json_values, min_size=1))
@settings(max_examples=100, deadline=None)
def test_equality_with_the_value_at_a_path_passes(result: dict[str, Any]) -> None:
    for key, value in result.items():
        assert run_check(result, {"path": key, "op": "==", "value": value}).passed
        assert not run_check(result, {"path": key, "op": "!=", "value": value}).passed
        assert run_check(result, {"path": key, "op": "exists"}).passed


# ---------------------------------------------------------------------- evaluation
RESULT = {
    "text": "Acme launched three products",
    "score": 0.8,
    "items": [{"name": "a", "tags": ["ai", "db"]}, {"name": "b"}],
    "meta": {"draft": False, "empty": None},
    "count": 3,
}


@pytest.mark.parametrize(("path", "expected"), [
    ("", RESULT),
    ("$", RESULT),
    ("$.score", 0.8),
    ("items.0.name", "a"),
    ("items.-1.name", "b"),
    ("items.0.tags.1", "db"),
    ("meta.empty", None),
    ("items.2", MISSING),
    ("items.x", MISSING),
    ("text.0", MISSING),
    ("nothing.here", MISSING),
])
def test_resolve_path_follows_keys_and_indexes(path: str, expected: Any) -> None:
    assert resolve_path(RESULT, path) is expected or resolve_path(RESULT, path) == expected


@pytest.mark.parametrize(("check", "passed"), [
    ({"path": "count", "op": "==", "value": 3}, True),
    ({"path": "count", "op": "==", "value": 3.0}, True),
    ({"path": "meta.draft", "op": "==", "value": 0}, False),
    ({"path": "meta.draft", "op": "==", "value": False}, True),
    ({"path": "count", "op": "!=", "value": 4}, True),
    ({"path": "score", "op": ">=", "value": 0.8}, True),
    ({"path": "score", "op": ">", "value": 0.8}, False),
    ({"path": "score", "op": "<", "value": 1}, True),
    ({"path": "score", "op": "<=", "value": 0.5}, False),
    ({"path": "text", "op": ">", "value": 3}, False),
    ({"path": "meta.draft", "op": ">=", "value": 0}, False),
    ({"path": "items.0.name", "op": "<", "value": "b"}, True),
    ({"path": "text", "op": "contains", "value": "three"}, True),
    ({"path": "text", "op": "contains", "value": "four"}, False),
    ({"path": "items.0.tags", "op": "contains", "value": "ai"}, True),
    ({"path": "meta", "op": "contains", "value": "draft"}, True),
    ({"path": "count", "op": "contains", "value": 3}, False),
    ({"path": "items", "op": "len>=", "value": 2}, True),
    ({"path": "items", "op": "len>=", "value": 3}, False),
    ({"path": "text", "op": "len<=", "value": 5}, False),
    ({"path": "count", "op": "len<=", "value": 5}, False),
    ({"path": "meta.empty", "op": "exists"}, True),
    ({"path": "meta.missing", "op": "exists"}, False),
    ({"path": "meta.missing", "op": "exists", "value": False}, True),
    ({"path": "text", "op": "matches", "value": r"^Acme\b"}, True),
    ({"path": "text", "op": "matches", "value": r"^Globex"}, False),
    ({"path": "count", "op": "matches", "value": r"3"}, False),
    ({"path": "nowhere", "op": "==", "value": None}, False),
])
def test_each_operator_passes_and_fails_as_documented(check: dict[str, Any],
                                                      passed: bool) -> None:
    validate_criteria({"checks": [check]}, None)
    outcome = run_check(RESULT, check)
    assert outcome.passed is passed, outcome.detail
    assert outcome.as_dict()["passed"] is passed


def test_a_missing_path_says_so() -> None:
    outcome = run_check(RESULT, {"path": "items.5.name", "op": "==", "value": "c"})
    assert "not found" in outcome.detail


def test_deadline_without_a_zone_is_utc() -> None:
    assert parse_deadline("2026-12-01T18:00:00") == dt.datetime(2026, 12, 1, 18, tzinfo=dt.UTC)
    assert parse_deadline("2026-12-01T18:00:00Z").tzinfo is not None
