"""The embedded backend's parts that need no model: the relaxed schema, tool replies, choice."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from agents.schemas import Plan
from runtime.config import Settings
from runtime.llm.backends.choice import build_backend
from runtime.llm.backends.embedded import (
    parse_tool_reply,
    relaxed_schema,
    template_messages,
    tool_reply_schema,
)
from runtime.llm.reply import BackendConfigError

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look up n.",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}},
                   "required": ["n"]}}}]


def test_the_relaxed_schema_drops_string_lengths_and_keeps_item_counts() -> None:
    schema = Plan.model_json_schema()
    relaxed = relaxed_schema(schema)
    assert "maxLength" not in json.dumps(relaxed) and "minLength" not in json.dumps(relaxed)
    assert relaxed["properties"]["priorities"]["maxItems"] == 5
    assert schema["properties"]["brief"]["maxLength"] == 1500  # the original is untouched
    # Only keywords go: a property named like one stays.
    named = {"type": "object", "properties": {"maxLength": {"type": "string",
                                                             "maxLength": 3}}}
    assert relaxed_schema(named) == {"type": "object",
                                     "properties": {"maxLength": {"type": "string"}}}
    # A count too large to unroll goes too (the full schema still checks it).
    assert relaxed_schema({"type": "array", "maxItems": 500}) == {"type": "array"}


def test_a_tool_round_reply_is_calls_or_the_answer() -> None:
    schema = tool_reply_schema(TOOLS, None)
    calls = {"tool_calls": [{"name": "lookup", "arguments": {"n": 2}}]}
    jsonschema.validate(calls, schema)
    jsonschema.validate({"content": "done"}, schema)
    text, parsed = parse_tool_reply(json.dumps(calls), None)
    assert text == "" and [(c.name, c.arguments) for c in parsed] == [("lookup", {"n": 2})]
    assert parse_tool_reply('{"content": "done"}', None) == ("done", ())
    answer = {"content": {"total": 3}}
    assert parse_tool_reply(json.dumps(answer), {"type": "object"}) == ('{"total": 3}', ())


def test_tool_messages_read_as_a_template_without_tool_roles() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "lookup", "arguments": {"n": 2}}}]},
        {"role": "tool", "tool_name": "lookup", "content": '{"value": 20}'}]
    out = template_messages(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert "lookup" in out[0]["content"] and "tool_calls" in out[2]["content"]
    assert out[3]["content"].startswith("Result of tool lookup")


def test_a_missing_model_file_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.llm.backends import embedded

    monkeypatch.setattr(embedded, "extra_installed", lambda: True)  # with or without it
    settings = Settings.model_validate({"llm": {"backend": "embedded"},
                                        "embedded": {"model": "/nonexistent.gguf"}})
    with pytest.raises(BackendConfigError, match=r"embedded\.model"):
        build_backend(settings)


def test_embedded_without_the_extra_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.llm.backends import embedded

    monkeypatch.setattr(embedded, "extra_installed", lambda: False)
    with pytest.raises(BackendConfigError, match="make install-embedded"):
        build_backend(Settings.model_validate({"llm": {"backend": "embedded"}}))
