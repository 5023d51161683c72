"""The hot path's JSON codec reads and writes what the standard library would.

``loads_fast`` is the ``jsonb`` loader of the store's engines and ``dumps_fast`` writes
every batched outcome, step and charge: a value that came back different from what
``json`` gives would be a silent change to a stored result.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.jsoncodec import dumps_fast, loads_fast

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)


@dataclasses.dataclass
class _Point:
    x: int


@given(JSON_VALUES)
def test_any_json_value_reads_back_as_json_reads_it(value: Any) -> None:
    text = json.dumps(value)
    assert loads_fast(text.encode()) == json.loads(text)
    assert loads_fast(memoryview(text.encode())) == json.loads(text)


@given(JSON_VALUES)
def test_any_json_value_is_written_as_json_writes_it(value: Any) -> None:
    assert json.loads(dumps_fast(value)) == json.loads(json.dumps(value, default=str))


@pytest.mark.parametrize("text", [
    '{"a": 12345678901234567890123}',       # above 64 bits: orjson would read a float
    "[-9999999999999999999, 99999999999999999999]",
    '{"n": 1e400}',                          # orjson refuses it; json reads infinity
    '{"phone": "12345678901234567890"}',    # long digits in a string: json answers too
])
def test_what_orjson_would_read_differently_is_read_by_json(text: str) -> None:
    assert loads_fast(text.encode()) == json.loads(text)
    assert repr(loads_fast(text)) == repr(json.loads(text))


@pytest.mark.parametrize("value", [
    {"at": dt.datetime(2026, 12, 2, 11, 0, tzinfo=dt.UTC)},  # str(): a space, not ISO T
    {"day": dt.date(2026, 12, 2)},
    {"point": _Point(3)},                    # str() of the dataclass, as json sends it
    {"usd": Decimal("0.10")},
    {"id": uuid.UUID(int=5)},
    {"big": 2 ** 70},                        # orjson refuses it; json writes it
    {1: "an int key"},                       # likewise
    {"surrogate": "\ud800"},                 # likewise
    ["é", "\u2603"],
])
def test_odd_values_are_written_as_json_writes_them(value: Any) -> None:
    assert json.loads(dumps_fast(value)) == json.loads(json.dumps(value, default=str))


def test_a_nan_is_written_as_null_which_postgresql_accepts() -> None:
    # json writes NaN, a token PostgreSQL refuses (the whole batch failed with it).
    assert json.loads(dumps_fast({"x": float("nan"), "y": float("inf")})) == \
        {"x": None, "y": None}
