"""The text forbidden_output searches is exactly what ``json`` writes of the result."""

from __future__ import annotations

import json
import math
import uuid
from decimal import Decimal
from typing import Any

import pytest

from policies.builtin import result_text

#: What ``json`` writes: the encoder the policy documents (``ensure_ascii=False``,
#: ``default=str``).
JSON_TEXT = json.JSONEncoder(ensure_ascii=False, default=str)

VALUES: list[Any] = [
    {"ok": True},
    {"a": [1, 2.5, -0.0, 1e300, None, False], "b": {"c": "d", "e": []}},
    {"text": "caf\u00e9 \u2603 \U0001f600 \"quoted\" back\\slash \n\t\x00\x1f end"},
    {1: "int key", 2.5: "float key", False: "bool key", None: "none key"},
    {"nan": math.nan, "inf": math.inf, "-inf": -math.inf},
    {"decimal": Decimal("1.10"), "uuid": uuid.UUID(int=7)},  # through default=str
    [{"x": (1, 2)}, "list at the top"],
    "a plain string result",
    42,
    None,
]


@pytest.mark.parametrize("value", VALUES)
def test_the_text_equals_json_encode(value: Any) -> None:
    assert result_text(value) == JSON_TEXT.encode(value)


def test_the_encoder_is_reused_without_keeping_state() -> None:
    first = result_text({"k": ["v"] * 3})
    for value in VALUES:
        result_text(value)
    assert result_text({"k": ["v"] * 3}) == first
