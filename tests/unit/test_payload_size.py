"""``max_payload_bytes`` means one thing: submission and the policy measure alike."""

from __future__ import annotations

import pytest

from agents.loader import load_builtins
from policies.builtin import payload_bytes, payload_bytes_over
from runtime.config import PoliciesSettings, Settings
from runtime.errors import BadInput
from runtime.wiring import build_root


def _settings(limit: int) -> Settings:
    return Settings(policies=PoliciesSettings(max_payload_bytes=limit))


def test_payload_bytes_is_compact_utf8_json() -> None:
    assert payload_bytes({"goal": "é", "n": [1, 2]}) == len('{"goal":"é","n":[1,2]}'.encode())


def test_submission_accepts_exactly_what_the_policy_accepts() -> None:
    goal = "écoute " * 40  # non-ASCII and spaces: \\u escapes and ", " would inflate it
    limit = payload_bytes({"goal": goal})
    task = build_root(load_builtins(), _settings(limit), goal=goal, agent="ceo")
    assert payload_bytes(task.payload) == limit
    with pytest.raises(BadInput, match=rf"payload is {limit} bytes; .* is {limit - 1}"):
        build_root(load_builtins(), _settings(limit - 1), goal=goal, agent="ceo")


#: Payloads where orjson and the standard encoder may write different text, or where
#: orjson refuses: float exponents, infinities, big integers, keys that are not strings,
#: escapes, non-ASCII text, nesting.
TRICKY = [
    {"goal": "plain"},
    {"x": [1e16, 1e-7, 1.5e300, -0.0, 123456789.123]},
    {"x": [float("inf"), float("-inf")] * 20},
    {"n": 2**70, "m": -(2**65)},
    {1: "non-string key", "k": "v"},
    {"s": "line\nbreak\ttab\x01\x1f\u2028 é 漢字 \U0001F600"},
    {"deep": [[[[{"a": [None, True, False, 0, -1]}]]]]},
    {"goal": "écoute " * 300},
]


@pytest.mark.parametrize("payload", TRICKY, ids=range(len(TRICKY)))
def test_the_fast_check_says_what_the_exact_measure_says(payload: dict) -> None:
    size = payload_bytes(payload)
    # Around the exact size, and far on either side: the same answer, the exact size.
    for limit in (0, 1, size // 4, size // 2, size - 1, size, size + 1, size * 2, size * 4):
        assert payload_bytes_over(payload, limit) == (size if size > limit else None), limit
