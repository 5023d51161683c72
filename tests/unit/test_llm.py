"""The model layer without a database: routing, the offline generator, the Ollama backend
against a fake Ollama server, replay files and backend choice."""

from __future__ import annotations

import datetime as dt
import json
import socket
import uuid
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import jsonschema
import ollama
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from runtime.config import Settings
from runtime.errors import ModelNotFound, TransientModelError
from runtime.llm.backends.choice import build_backend
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.backends.ollama import OllamaBackend
from runtime.llm.backends.replay import (
    ReplayBackend,
    load_replay_file,
    records_from_calls,
    write_replay_file,
)
from runtime.llm.backends.schema_instance import SchemaUnsatisfiable, instance_for_schema
from runtime.llm.reply import (
    BackendConfigError,
    BadModelReply,
    ReplayMiss,
    estimate_tokens,
    request_key,
    request_text,
)
from runtime.llm.routing import decide_route
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

PROMPT = "Find the three biggest competitors of Acme Robotics in Europe and rank them"


def make_settings(**sections: Any) -> Settings:
    return Settings.model_validate(sections)


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def valid(schema: dict[str, Any], instance: Any) -> None:
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator.validate(instance)


# ---------------------------------------------------------------------- routing
@pytest.mark.parametrize(("length", "route"), [(0, "local"), (99, "local"), (100, "local"),
                                               (101, "cloud"), (240, "cloud")])
def test_route_by_prompt_length_is_strictly_greater_than_threshold(length: int,
                                                                    route: str) -> None:
    decision = decide_route("x" * length, 0, make_settings())
    assert decision.route == route
    assert decision.model == ("qwen3:14b" if route == "cloud" else "llama3.2:latest")


@pytest.mark.parametrize(("depth", "route"), [(0, "local"), (5, "local"), (6, "cloud")])
def test_route_by_pending_depth_is_strictly_greater_than_threshold(depth: int,
                                                                   route: str) -> None:
    assert decide_route("short", depth, make_settings()).route == route


def test_route_reason_names_the_signal_and_numbers() -> None:
    s = make_settings()
    assert decide_route("y" * 240, 0, s).reason == "prompt 240 chars > prompt_threshold 100"
    assert decide_route("y", 7, s).reason == "pending queue 7 > pending_threshold 5"
    both = decide_route("y" * 101, 6, s).reason
    assert "prompt 101 chars > prompt_threshold 100" in both
    assert "pending queue 6 > pending_threshold 5" in both
    assert decide_route("y" * 10, 2, s).reason == (
        "prompt 10 chars <= prompt_threshold 100 and pending queue 2 <= pending_threshold 5")


def test_route_uses_configured_thresholds_and_models() -> None:
    s = make_settings(routing={"prompt_threshold": 3, "pending_threshold": 0},
                      models={"local": "tiny", "cloud": "huge"})
    assert decide_route("abc", 0, s).model == "tiny"
    assert decide_route("abcd", 0, s).model == "huge"
    assert decide_route("a", 1, s).model == "huge"


def test_route_refuses_a_negative_queue_depth() -> None:
    with pytest.raises(ValueError, match="pending_depth"):
        decide_route("x", -1, make_settings())


# ---------------------------------------------------------------------- offline generator
class Threat(StrEnum):
    low = "low"
    medium = "medium"
    high = "high"


class Node(BaseModel):
    label: str
    children: list[Node] = []


class Competitor(BaseModel):
    name: str = Field(min_length=3, max_length=40)
    ticker: str = Field(pattern=r"^[A-Z]{3,5}$")
    threat: Threat
    share: float = Field(ge=0, le=1)
    growth: float = Field(gt=-1, lt=1)
    employees: int | None = Field(default=None, gt=0, multiple_of=10)
    founded: dt.date
    seen_at: dt.datetime
    id: uuid.UUID
    price: Decimal = Field(ge=0, le=1000)


class Report(BaseModel):
    competitors: list[Competitor] = Field(min_length=3, max_length=5)
    tags: set[str]
    scores: dict[str, int]
    pair: tuple[int, str]
    tree: Node
    kind: Literal["brief", "full"]
    note: str | None = None
    rank: int = Field(ge=1, le=3)


@pytest.mark.parametrize("model", [Report, Competitor, Node])
def test_offline_instance_is_valid_for_pydantic_schemas(model: type[BaseModel]) -> None:
    schema = model.model_json_schema()
    instance = instance_for_schema(schema, PROMPT)
    valid(schema, instance)
    model.model_validate(instance)


def test_offline_instance_is_deterministic_and_depends_on_the_prompt() -> None:
    schema = Report.model_json_schema()
    first = instance_for_schema(schema, PROMPT)
    assert instance_for_schema(schema, PROMPT) == first
    assert instance_for_schema(schema, PROMPT + " today") != first


def test_offline_strings_are_labelled_with_the_prompt() -> None:
    data = instance_for_schema(Report.model_json_schema(), PROMPT)
    assert data["competitors"][0]["name"].startswith("offline: Find")
    assert data["note"].startswith("offline: Find the three biggest competitors")
    assert len(data["competitors"]) == 3


def test_offline_generator_cuts_recursion() -> None:
    data = instance_for_schema(Node.model_json_schema(), PROMPT)
    depth, node = 0, data
    while node.get("children"):
        node, depth = node["children"][0], depth + 1
    assert 0 < depth < 10


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 3, "uniqueItems": True},
    {"type": "object", "properties": {}, "minProperties": 2,
     "additionalProperties": {"type": "integer", "multipleOf": 7, "minimum": 1}},
    {"type": "number", "multipleOf": 0.25, "minimum": 1, "maximum": 2},
    {"type": ["string", "null"], "maxLength": 5},
    {"allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {"type": "object", "required": ["x"],
                                                        "properties": {"x": {"const": 3}}}}},
    {"type": "string", "pattern": r"^(ab|cd)+-\d{2}$"},
    {"type": "string", "format": "email"},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "null"}], "items": False},
])
def test_offline_instance_is_valid_for_tricky_schemas(schema: dict[str, Any]) -> None:
    valid(schema, instance_for_schema(schema, PROMPT))


def test_offline_generator_names_what_it_cannot_satisfy() -> None:
    with pytest.raises(SchemaUnsatisfiable, match="'count'"):
        instance_for_schema({"type": "object", "required": ["count"], "properties": {
            "count": {"type": "integer", "minimum": 5, "maximum": 4}}}, PROMPT)
    with pytest.raises(SchemaUnsatisfiable, match=r"\$ref"):
        instance_for_schema({"$ref": "#/$defs/Missing"}, PROMPT)


_leaf = st.one_of(
    st.just({"type": "string"}),
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 20), st.integers(0, 30)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 50)),
    st.builds(lambda lo, span: {"type": "number", "exclusiveMinimum": lo,
                                "exclusiveMaximum": lo + span},
              st.floats(-1000, 1000, allow_nan=False), st.floats(0.5, 100)),
    st.just({"type": "boolean"}),
    st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=4, unique=True)
    .map(lambda values: {"enum": values}),
    st.sampled_from([{"type": "string", "format": f}
                     for f in ("date-time", "date", "uuid", "email", "uri")]),
    st.just({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}),
)


def _object(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    props = st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), children,
                            min_size=1, max_size=4)
    return props.flatmap(lambda p: st.sets(st.sampled_from(sorted(p))).map(
        lambda req: {"type": "object", "properties": p, "required": sorted(req),
                     "additionalProperties": False}))


_schemas = st.recursive(_leaf, lambda children: st.one_of(
    st.builds(lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo,
                                       "maxItems": lo + extra},
              children, st.integers(0, 3), st.integers(0, 3)),
    _object(children),
    children.map(lambda s: {"anyOf": [s, {"type": "null"}]}),
), max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_schemas, prompt=st.text(max_size=80))
def test_offline_instance_is_valid_for_generated_schemas(schema: dict[str, Any],
                                                         prompt: str) -> None:
    instance = instance_for_schema(schema, prompt)
    valid(schema, instance)
    assert instance_for_schema(schema, prompt) == instance


def test_offline_backend_labels_text_and_counts_tokens() -> None:
    reply = OfflineBackend().chat("m", PROMPT, "be brief", None, 100)
    assert reply.text.startswith("offline: Find the three")
    assert reply.data is None and reply.backend == "offline" and reply.model == "m"
    assert reply.prompt_tokens == estimate_tokens("be brief") + estimate_tokens(PROMPT)
    assert 0 < reply.completion_tokens <= 100
    structured = OfflineBackend().chat("m", PROMPT, None, Competitor.model_json_schema(), 3)
    assert json.loads(structured.text) == structured.data
    assert structured.completion_tokens == 3


def test_estimate_tokens() -> None:
    assert estimate_tokens("") == 0
    assert estimate_tokens("one two three") == 4
    assert estimate_tokens("x" * 400) == 100


# ---------------------------------------------------------------------- Ollama backend
def test_ollama_chat_plain_reports_the_servers_token_counts(fake_ollama: FakeOllama) -> None:
    backend = OllamaBackend(fake_ollama.url, 5.0)
    reply = backend.chat("llama3.2:latest", PROMPT, "You are terse.", None, 64)
    assert reply.text.startswith("fake: Find the three")
    assert reply.data is None and reply.backend == "ollama"
    assert reply.prompt_tokens == fake_ollama.prompt_tokens > 0
    assert reply.completion_tokens == fake_ollama.completion_tokens > 0
    sent = fake_ollama.requests[0]
    assert sent["messages"][0] == {"role": "system", "content": "You are terse."}
    assert sent["options"]["num_predict"] == 64 and sent["stream"] is False
    assert "format" not in sent


def test_ollama_chat_structured_sends_the_schema_and_parses(fake_ollama: FakeOllama) -> None:
    schema = Competitor.model_json_schema()
    reply = OllamaBackend(fake_ollama.url, 5.0).chat("qwen3:14b", PROMPT, None, schema, 512)
    assert fake_ollama.requests[0]["format"] == schema
    assert reply.data == json.loads(reply.text)
    Competitor.model_validate(reply.data)


def test_ollama_reply_that_is_not_json_is_a_clear_error(fake_ollama: FakeOllama) -> None:
    fake_ollama.reply_text = "Sure! Here are the competitors:"
    with pytest.raises(BadModelReply, match="not JSON") as err:
        OllamaBackend(fake_ollama.url, 5.0).chat("qwen3:14b", PROMPT, None,
                                                  Competitor.model_json_schema(), 512)
    assert err.value.reply is not None and err.value.reply.completion_tokens > 0


def test_ollama_reply_that_does_not_fit_the_schema_names_the_field(
        fake_ollama: FakeOllama) -> None:
    fake_ollama.reply_text = json.dumps({"name": "Acme"})
    with pytest.raises(BadModelReply, match="does not fit the schema"):
        OllamaBackend(fake_ollama.url, 5.0).chat("qwen3:14b", PROMPT, None,
                                                  Competitor.model_json_schema(), 512)


def test_ollama_unknown_model_raises_model_not_found(fake_ollama: FakeOllama) -> None:
    with pytest.raises(ModelNotFound, match="'mistral:7b' not found") as err:
        OllamaBackend(fake_ollama.url, 5.0).chat("mistral:7b", PROMPT, None, None, 10)
    assert err.value.model == "mistral:7b"


def test_ollama_slow_reply_past_the_timeout_is_transient(fake_ollama: FakeOllama) -> None:
    fake_ollama.delay_seconds = 2.0
    with pytest.raises(TransientModelError, match=r"did not answer within 0\.2 s"):
        OllamaBackend(fake_ollama.url, 0.2).chat("llama3.2:latest", PROMPT, None, None, 10)


def test_ollama_refused_connection_is_transient() -> None:
    url = closed_port_url()
    with pytest.raises(TransientModelError, match="unreachable"):
        OllamaBackend(url, 2.0).chat("llama3.2:latest", PROMPT, None, None, 10)
    assert OllamaBackend(url, 2.0).probe(0.5) is False


def test_ollama_cloud_route_goes_to_the_cloud_server(fake_ollama: FakeOllama) -> None:
    cloud = FakeOllama().start()
    try:
        backend = OllamaBackend(fake_ollama.url, 5.0, cloud_url=cloud.url)
        backend.chat("qwen3:14b", PROMPT, None, None, 10, route="cloud")
        backend.chat("llama3.2:latest", PROMPT, None, None, 10, route="local")
        assert (cloud.chats, fake_ollama.chats) == (1, 1)
        assert backend.host_for("cloud") == cloud.url
    finally:
        cloud.stop()


def test_fake_server_streams_ndjson_with_a_final_done_chunk(fake_ollama: FakeOllama) -> None:
    client = ollama.Client(host=fake_ollama.url, timeout=5)
    parts = list(client.chat(model="llama3.2:latest",
                             messages=[{"role": "user", "content": PROMPT}], stream=True))
    assert len(parts) > 2
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content or "" for p in parts).startswith("fake: Find")
    assert parts[-1].eval_count == fake_ollama.completion_tokens
    assert parts[-1].prompt_eval_count == fake_ollama.prompt_tokens
    assert parts[-1].total_duration is not None
    whole = client.chat(model="llama3.2:latest",
                        messages=[{"role": "user", "content": PROMPT}], stream=False)
    assert whole.message.content == "".join(p.message.content or "" for p in parts)
    assert [m.model for m in client.list().models] == ["llama3.2:latest", "qwen3:14b"]


# ---------------------------------------------------------------------- backend choice
def test_auto_uses_ollama_when_it_answers(fake_ollama: FakeOllama) -> None:
    backend, why = build_backend(make_settings(ollama={"url": fake_ollama.url}))
    assert backend.name == "ollama"
    assert why == f"Ollama answered at {fake_ollama.url}; using it (llm.backend = 'auto')"


def test_auto_falls_back_to_offline_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.llm.backends import embedded

    monkeypatch.setattr(embedded, "extra_installed", lambda: False)  # (CI installs it)
    url = closed_port_url()
    backend, why = build_backend(make_settings(ollama={"url": url}))
    assert backend.name == "offline"
    assert why == (f"no Ollama answered at {url} and the embedded extra is not installed "
                   "('make install-embedded'); using the offline backend "
                   "(deterministic, labelled offline)")


def test_explicit_backends_and_their_sentences(tmp_path: Path) -> None:
    url = closed_port_url()
    backend, why = build_backend(make_settings(llm={"backend": "ollama"}, ollama={"url": url}))
    assert backend.name == "ollama" and "does not answer now" in why
    backend, why = build_backend(make_settings(llm={"backend": "offline"}))
    assert backend.name == "offline" and "labelled offline" in why
    with pytest.raises(BackendConfigError, match="replay_file"):
        build_backend(make_settings(llm={"backend": "replay"}))
    with pytest.raises(BackendConfigError, match="does not exist"):
        build_backend(make_settings(llm={"backend": "replay",
                                         "replay_file": str(tmp_path / "none.jsonl")}))


# ---------------------------------------------------------------------- replay
def test_request_key_ignores_the_model_but_not_system_or_schema() -> None:
    schema = Competitor.model_json_schema()
    assert request_text(PROMPT) == PROMPT
    assert request_key(PROMPT) != request_key(PROMPT, "sys")
    assert request_key(PROMPT) != request_key(PROMPT, None, schema)
    assert request_key(PROMPT, "sys", schema) == request_key(PROMPT, "sys", dict(schema))
    assert "[format] json schema Competitor sha256:" in request_text(PROMPT, None, schema)


def _calls(*items: tuple[str, str | None, str | None],
           backend: str = "ollama") -> list[dict[str, Any]]:
    return [{"prompt": prompt, "response": response, "error": error, "prompt_tokens": 11,
             "completion_tokens": 7, "model": "llama3.2:latest", "route": "local",
             "backend": backend}
            for prompt, response, error in items]


def test_replay_round_trip_serves_the_same_answers_in_order(tmp_path: Path) -> None:
    schema = Competitor.model_json_schema()
    offline = OfflineBackend()
    first = offline.chat("m", PROMPT, None, schema, 500)
    second = offline.chat("m", PROMPT + " again", None, schema, 500)
    stored = request_text(PROMPT, None, schema)
    calls = _calls((stored, first.text, None),
                   (stored, None, "TransientModelError: down"),
                   (stored, second.text, None),
                   (request_text("plain"), "a plain answer", None))
    records = records_from_calls(calls)
    assert [r.occurrence for r in records] == [0, 1, 0]
    path = tmp_path / "run.jsonl"
    assert write_replay_file(path, records) == 3
    replay = ReplayBackend(path)
    assert replay.size == 3
    a = replay.chat("other-model", PROMPT, None, schema, 500)
    b = replay.chat("other-model", PROMPT, None, schema, 500)
    c = replay.chat("other-model", PROMPT, None, schema, 500)
    assert (a.data, b.data, c.data) == (first.data, second.data, second.data)
    assert a.backend == "replay" and (a.prompt_tokens, a.completion_tokens) == (11, 7)
    assert not replay.offline and not a.offline
    assert replay.chat("x", "plain", None, None, 5).text == "a plain answer"


def test_replay_of_an_offline_run_stays_labelled_offline(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    write_replay_file(path, records_from_calls(_calls(("q", "offline: q", None),
                                                      backend="offline")))
    replay = ReplayBackend(path)
    assert replay.offline and replay.chat("m", "q", None, None, 5).offline
    _, why = build_backend(make_settings(llm={"backend": "replay", "replay_file": str(path)}))
    assert why == (f"replaying 1 recorded responses from {path} (recorded with the offline "
                   "backend) (llm.backend = 'replay')")


def test_replay_miss_names_the_prompt(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    write_replay_file(path, records_from_calls(_calls(("known", "yes", None))))
    with pytest.raises(ReplayMiss, match="'Summarise the quarterly numbers'"):
        ReplayBackend(path).chat("m", "Summarise the quarterly numbers", None, None, 5)
    with pytest.raises(ReplayMiss):
        ReplayBackend(path).chat("m", "known", "with a system prompt", None, 5)


def test_malformed_replay_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    write_replay_file(path, records_from_calls(_calls(("known", "yes", None))))
    with path.open("a") as out:
        out.write('{"key": "abc"}\n')
    with pytest.raises(BackendConfigError, match=r"bad.jsonl:2: missing prompt"):
        load_replay_file(path)


# ---------------------------------------------------------------------- repair helpers
def test_request_hash_covers_model_messages_schema_and_options() -> None:
    from runtime.llm.request import request_hash

    messages = [{"role": "user", "content": PROMPT}]
    base = request_hash("m", messages, None, 100, False)
    assert base == request_hash("m", [dict(m) for m in messages], None, 100, False)
    assert len({base, request_hash("n", messages, None, 100, False),
                request_hash("m", [{"role": "user", "content": "other"}], None, 100, False),
                request_hash("m", messages, {"type": "object"}, 100, False),
                request_hash("m", messages, None, 101, False),
                request_hash("m", messages, None, 100, True)}) == 6


def test_a_structured_reply_cut_at_the_token_limit_is_bad() -> None:
    from runtime.llm.reply import ModelReply, checked_reply

    schema = Competitor.model_json_schema()
    cut = ModelReply('{"name": "Ac', None, 5, 64, 0.0, "m", "ollama", done_reason="length")
    with pytest.raises(BadModelReply, match="token limit") as err:
        checked_reply(cut, schema)
    assert err.value.reply is cut
    with pytest.raises(BadModelReply, match="replied with nothing"):
        checked_reply(ModelReply("  ", None, 5, 0, 0.0, "m", "ollama"), schema)
    plain = ModelReply("not json, and fine", None, 5, 3, 0.0, "m", "ollama")
    assert checked_reply(plain, None) is plain


def test_retry_after_is_read_in_seconds() -> None:
    from runtime.llm.backends.ollama import retry_after_seconds

    assert retry_after_seconds("3") == 3.0 and retry_after_seconds(" 0.5 ") == 0.5
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("Wed, 21 Oct 2026 07:28:00 GMT") is None


def test_the_offline_backend_misbehaves_as_scripted_then_behaves() -> None:
    schema = Competitor.model_json_schema()
    backend = OfflineBackend(script=["broken_json", "wrong_shape", "empty", "length"])
    for expected in ("not JSON", "does not fit", "nothing", "token limit"):
        with pytest.raises(BadModelReply, match=expected):
            backend.chat("m", PROMPT, None, schema, 500)
    assert Competitor.model_validate(backend.chat("m", PROMPT, None, schema, 500).data)
    with pytest.raises(ValueError, match="unknown offline behaviours"):
        OfflineBackend(script=["sulk"])


def test_the_fake_server_answers_429_with_retry_after_and_thinks_on_request(
        fake_ollama: FakeOllama) -> None:
    fake_ollama.script = ["429"]
    fake_ollama.retry_after = 7
    backend = OllamaBackend(fake_ollama.url, 5.0)
    with pytest.raises(TransientModelError, match="429") as err:
        backend.chat("llama3.2:latest", PROMPT, None, None, 10)
    assert getattr(err.value, "status", None) == 429
    assert getattr(err.value, "retry_after", None) == 7.0
    reply = backend.chat("qwen3:14b", PROMPT, None, None, 200, think=True)
    assert reply.thinking and reply.thinking.startswith("fake thinking")
    assert not reply.text.startswith("fake thinking")
    assert reply.completion_tokens == estimate_tokens(reply.text) + estimate_tokens(
        reply.thinking)
