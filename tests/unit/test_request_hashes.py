"""A durable call's request hash: one serialisation for several models, the same bytes."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from runtime.llm.request import request_hash, request_hashes


def hashed_as_recorded(model: str, messages: Any, schema: Any, max_tokens: int, think: bool,
                       tools: Any = None) -> str:
    """The definition the records were made with (a changed hash would replay nothing)."""
    body = {"model": model, "messages": messages, "schema": schema,
            "options": {"num_predict": max_tokens, "think": think}}
    if tools:
        body["tools"] = tools
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize(("messages", "schema", "tools"), [
    ([{"role": "user", "content": 'h\u00e9 "quoted" \u2028'}], None, None),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
     {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}},
     [{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": [1, 2]}}}]),
    ([{"role": "user", "content": "x"}], {}, []),
])
@pytest.mark.parametrize(("max_tokens", "think"), [(8, False), (4096, True)])
def test_request_hashes_are_the_recorded_hashes(messages: Any, schema: Any, tools: Any,
                                                max_tokens: int, think: bool) -> None:
    models = ["qwen3:1.7b", "gpt-oss:120b-cloud"]
    hashes = request_hashes(models, messages, schema, max_tokens, think, tools)
    assert set(hashes) == set(models) and len(set(hashes.values())) == 2
    for model in models:
        expected = hashed_as_recorded(model, messages, schema, max_tokens, think, tools)
        assert hashes[model] == expected
        assert request_hash(model, messages, schema, max_tokens, think, tools) == expected
