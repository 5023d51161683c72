"""The embedded backend's parts that need no model: the grammar's schema, tool replies, choice."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from agents.judge import JudgeOutput, PairwiseOutput
from agents.schemas import (
    CompetitorFindings,
    IntelDraft,
    MarketFindings,
    Plan,
    ReportDraft,
    TrendFindings,
)
from runtime.config import Settings
from runtime.llm.backends.choice import build_backend
from runtime.llm.backends.embedded import (
    CHATML_TEMPLATE,
    fallback_template,
    parse_tool_reply,
    template_messages,
    tool_reply_schema,
)
from runtime.llm.backends.schema_grammar import closed_schema, grammar_text, guidance_installed
from runtime.llm.reply import BackendConfigError, ModelRequestError

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look up n.",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}},
                   "required": ["n"]}}}]
#: The schemas the seed's agents ask the model for.
SEED_SCHEMAS = (Plan, ReportDraft, IntelDraft, CompetitorFindings, MarketFindings,
                TrendFindings, JudgeOutput, PairwiseOutput)


def test_the_grammar_closes_objects_and_keeps_every_rule_of_the_schema() -> None:
    schema = Plan.model_json_schema()
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False  # no keys nobody reads
    assert closed["properties"]["brief"] == schema["properties"]["brief"]  # lengths kept
    assert closed["properties"]["priorities"]["maxItems"] == 5
    assert "additionalProperties" not in schema  # the original is untouched
    # An object that says what it allows keeps it; a property named like a keyword is a
    # property; objects inside $defs and anyOf are closed too.
    free = {"type": "object", "additionalProperties": True}
    assert closed_schema(free) == free
    named = {"type": "object", "properties": {"properties": {"type": "string"}}}
    assert closed_schema(named)["properties"] == {"properties": {"type": "string"}}
    nested = {"$defs": {"A": {"type": "object", "properties": {"x": {"type": "integer"}}}},
              "anyOf": [{"$ref": "#/$defs/A"}, {"type": "object", "properties": {}}]}
    out = closed_schema(nested)
    assert out["$defs"]["A"]["additionalProperties"] is False
    assert out["anyOf"][1]["additionalProperties"] is False


@pytest.mark.skipif(not guidance_installed(),
                    reason="llguidance (the embedded extra) is not installed: "
                           "'make install-embedded'")
def test_every_seed_schema_has_a_grammar_and_a_broken_one_says_why() -> None:
    for schema in SEED_SCHEMAS:
        assert grammar_text(schema.model_json_schema())
    with pytest.raises(ModelRequestError, match=r"has no grammar: (.|\n)*look-around"):
        grammar_text({"type": "string", "pattern": "(?<=x)y"})


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


def test_a_file_without_a_chat_template_gets_its_familys_turns() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    assert fallback_template("llama") == fallback_template(None) == CHATML_TEMPLATE
    # The binding renders with trim_blocks and lstrip_blocks, as here.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    gemma = env.from_string(fallback_template("gemma3"))
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
    assert gemma.render(bos_token="<bos>", messages=messages) == (
        "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
        "<start_of_turn>user\nV<end_of_turn>\n<start_of_turn>model\n")


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
