"""``max_payload_bytes`` means one thing: submission and the policy measure alike."""

from __future__ import annotations

import pytest

from agents.loader import load_builtins
from policies.builtin import payload_bytes
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
