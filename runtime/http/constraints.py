"""What the request models say about their values, so the OpenAPI document says it too.

The handlers refuse values PostgreSQL cannot store (a NUL character), budgets out of the
columns' range, blank notes where a note is required, and so on. Each such rule is a
pydantic constraint here, so the same rule is both checked (422 with a readable message,
see :mod:`runtime.http.messages`) and published in the document: a client generated
from it, or a test generator such as schemathesis, sends only what the server accepts.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema

#: Text PostgreSQL can store: anything but NUL.
STORABLE_TEXT = r"^[^\x00]*$"
#: Every character Python's ``str.strip()`` strips, spelled out: the regex engines that
#: read this (pydantic's, Python's, a client's ECMAScript) disagree on ``\s``.
_SPACE = r"\t\n\x0b\x0c\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
#: Text with at least one character that is not white space (and no NUL).
NOT_BLANK_TEXT = rf"^[^\x00]*[^\x00{_SPACE}][^\x00]*$"
#: The largest value of a PostgreSQL ``integer`` column (budgets, depths).
MAX_INT = 2**31 - 1
#: Budgets in dollars are below this (the column's precision).
MAX_USD = Decimal("1000000")
#: A dollar amount written as a string: digits, an optional fraction (no sign, no exponent).
USD_STRING = r"^[0-9]{1,6}(\.[0-9]{1,12})?$"
#: What each pattern means, for the 422 message (pydantic would print the pattern).
PATTERN_MEANINGS: dict[str, str] = {
    STORABLE_TEXT: "must not contain a NUL character (\\u0000), which PostgreSQL cannot store",
    NOT_BLANK_TEXT: "must not be blank (and must not contain a NUL character)",
    USD_STRING: "must be a number of dollars from 0 to 999999.999999999999 "
                "(a JSON number, or a string of digits such as \"1.50\")",
}


#: The document's name for any JSON value PostgreSQL can store (no NUL in a string or a
#: key, at any depth): free-form fields (payloads, answers) refer to it.
STORABLE_JSON = "StorableJSON"
STORABLE_JSON_REF = {"$ref": f"#/components/schemas/{STORABLE_JSON}"}
#: What a model's schema holds where the document will hold ``STORABLE_JSON_REF``
#: (pydantic refuses a ``$ref`` to a schema it did not make; document.py swaps them).
STORABLE_JSON_MARK = {"x-orgchart": STORABLE_JSON}
STORABLE_JSON_SCHEMA: dict[str, Any] = {
    "description": "Any JSON value; no string or key holds a NUL character (\\u0000).",
    "anyOf": [
        {"type": "string", "pattern": STORABLE_TEXT},
        {"type": ["number", "boolean", "null"]},
        {"type": "array", "items": STORABLE_JSON_REF},
        {"type": "object", "propertyNames": {"pattern": STORABLE_TEXT},
         "additionalProperties": STORABLE_JSON_REF},
    ],
}


def meaning(pattern: str) -> str | None:
    """What a pattern means in words (None: not one that has been described)."""
    return PATTERN_MEANINGS.get(pattern)


def describe_pattern(pattern: str, words: str) -> str:
    """Say what ``pattern`` means in 422 messages (pydantic would print the pattern)."""
    PATTERN_MEANINGS[pattern] = words
    return pattern


def _json_integer(value: Any) -> Any:
    # JSON has one number type: 3.0 is the integer 3 (as JSON Schema says), but a boolean
    # or a string of digits is not an integer, whatever pydantic's lax mode would make of it.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be a whole number")
        return int(value)
    return value


def _usd_text(value: Any) -> Any:
    if isinstance(value, str) and not re.fullmatch(USD_STRING, value):
        raise ValueError(PATTERN_MEANINGS[USD_STRING])
    if isinstance(value, bool):
        raise ValueError("must be a number of dollars, not a boolean")
    return value


#: A budget in dollars: a number ``0 <= x < 1e6`` or a string of digits (exact decimals).
Usd = Annotated[
    Decimal,
    BeforeValidator(_usd_text),
    Field(ge=0, lt=MAX_USD, allow_inf_nan=False),
    WithJsonSchema({"anyOf": [
        {"type": "number", "minimum": 0, "exclusiveMaximum": int(MAX_USD)},
        {"type": "string", "pattern": USD_STRING},
    ]}),
]
#: An integer as JSON writes it (not a boolean, not a string).
Int = Annotated[int, BeforeValidator(_json_integer)]
#: A boolean as JSON writes it (not 0, 1, "yes").
Bool = Annotated[bool, Field(strict=True)]
#: A token budget: what the ``integer`` column holds.
Tokens = Annotated[int, Field(ge=0, le=MAX_INT), BeforeValidator(_json_integer)]
#: Seconds per run of a task: at least one, what the ``integer`` column holds.
Seconds = Annotated[int, Field(ge=1, le=MAX_INT), BeforeValidator(_json_integer)]
#: Any JSON value the database can store (the document says so with ``StorableJSON``).
Json = Annotated[Any, WithJsonSchema(STORABLE_JSON_MARK)]
#: A JSON object the database can store.
JsonObject = Annotated[dict[str, Any], WithJsonSchema({
    "type": "object", "propertyNames": {"pattern": STORABLE_TEXT},
    "additionalProperties": STORABLE_JSON_MARK})]
#: Text that can be stored (no NUL).
Text = Annotated[str, Field(pattern=STORABLE_TEXT)]
#: Text that must say something: not blank, no NUL.
NonBlankText = Annotated[str, Field(pattern=NOT_BLANK_TEXT)]


#: The format of a ``matches`` check's value: a regular expression as Python's ``re``
#: reads it (JSON Schema's ``regex`` is ECMA-262's dialect, which differs: ``]``, ``(?P<``).
PYTHON_REGEX = "python-regex"


def _check(ops: list[str], value: dict[str, Any] | None) -> dict[str, Any]:
    check: dict[str, Any] = {
        "type": "object", "additionalProperties": False, "required": ["path", "op"],
        "properties": {"path": {"type": "string", "pattern": STORABLE_TEXT},
                       "op": {"enum": ops}},
    }
    if value is not None:
        check["properties"]["value"] = value
        if ops != ["exists"]:
            check["required"].append("value")
    return check


#: ``success_criteria`` (``policies/criteria.py``): what :func:`validate_criteria` takes.
SUCCESS_CRITERIA_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "schema": {"description": "A JSON Schema the result must match.",
                   "anyOf": [{"type": "boolean"},
                             {"type": "object", "propertyNames": {"pattern": STORABLE_TEXT},
                              "additionalProperties": STORABLE_JSON_MARK}]},
        "checks": {"type": "array", "items": {"oneOf": [
            _check(["==", "!=", "contains"], STORABLE_JSON_MARK),
            _check([">", ">=", "<", "<="], {"anyOf": [
                {"type": "number"}, {"type": "string", "pattern": STORABLE_TEXT}]}),
            _check(["len>=", "len<="], {"type": "integer", "minimum": 0}),
            _check(["exists"], {"type": "boolean"}),
            _check(["matches"], {"type": "string", "format": PYTHON_REGEX,
                                 "pattern": STORABLE_TEXT}),
        ]}},
        "rubric": {"type": "object", "additionalProperties": False, "required": ["text"],
                   "properties": {"text": {"type": "string", "pattern": NOT_BLANK_TEXT},
                                  "threshold": {"type": "number", "minimum": 0,
                                                "maximum": 1}}},
    },
}
#: ``kill_criteria``: limits on spend and time, and a deadline.
KILL_CRITERIA_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "max_cost_usd": {"type": "number", "minimum": 0},
        "max_seconds": {"type": "number", "minimum": 0},
        "max_tokens": {"type": "integer", "minimum": 0},
        "max_child_failures": {"type": "integer", "minimum": 0},
        "deadline": {"type": "string", "format": "date-time",
                     "description": "ISO-8601; a time without a zone is UTC."},
    },
}


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _success_counts(value: Any) -> Any:
    # JSON Schema's integer takes 3.0; policies.criteria counts Python ints only.
    checks = value.get("checks") if isinstance(value, dict) else None
    if isinstance(checks, list):
        for check in checks:
            if isinstance(check, dict) and check.get("op") in ("len>=", "len<="):
                check["value"] = _whole(check.get("value"))
    return value


def _kill_counts(value: Any) -> Any:
    if isinstance(value, dict):
        for key in ("max_tokens", "max_child_failures"):
            if key in value:
                value[key] = _whole(value[key])
    return value


#: The criteria as request fields: checked by ``policies.criteria.validate_criteria``.
SuccessCriteria = Annotated[dict[str, Any], BeforeValidator(_success_counts),
                            WithJsonSchema(SUCCESS_CRITERIA_SCHEMA)]
KillCriteria = Annotated[dict[str, Any], BeforeValidator(_kill_counts),
                         WithJsonSchema(KILL_CRITERIA_SCHEMA)]
