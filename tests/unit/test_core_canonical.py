"""Canonical JSON and its hash are pinned: durable identity must never drift.

Request hashes, schema digests, steps' arguments, datasets' versions and task requests
are stored; replay finds a record by them. Each value below was computed before the
copies were merged into :mod:`runtime.core.canonical` (issue 46) and must stay.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from decimal import Decimal

from runtime.core.canonical import (
    canonical_json,
    canonical_json_spaced,
    canonical_sha256,
    sha256_hex,
)

VALUE = {
    "b": [1, 2.5, 1e-7, 10**20, Decimal("1.10")],
    "a": {"z": "é ü 日本 🙂", "y": None, "x": True},
    "when": datetime.datetime(2026, 12, 7, 17, 36, 32, 5, tzinfo=datetime.UTC),
    "d": datetime.date(2026, 1, 2),
    "f": 0.1 + 0.2,
}
COMPACT = ('{"a":{"x":true,"y":null,"z":"\\u00e9 \\u00fc \\u65e5\\u672c \\ud83d\\ude42"},'
           '"b":[1,2.5,1e-07,100000000000000000000,"1.10"],"d":"2026-01-02",'
           '"f":0.30000000000000004,"when":"2026-12-07 17:36:32.000005+00:00"}')


def test_canonical_json_is_pinned() -> None:
    assert canonical_json(VALUE) == COMPACT
    assert canonical_sha256(VALUE) == (
        "51f4c16f2f3d345a1d8e1f68f3964982b6ab8ab2e404c7ff3a402bf2ed8f7890")
    assert canonical_sha256(VALUE) == hashlib.sha256(COMPACT.encode()).hexdigest()
    assert canonical_json(VALUE) == json.dumps(VALUE, sort_keys=True, separators=(",", ":"),
                                               default=str)


def test_the_spaced_form_is_pinned() -> None:
    assert canonical_json_spaced({"b": [1, "é"], "a": {"c": None}}) == (
        '{"a": {"c": null}, "b": [1, "\\u00e9"]}')
    assert canonical_json_spaced(VALUE) == json.dumps(VALUE, sort_keys=True, default=str)


def test_sha256_hex() -> None:
    assert sha256_hex("é") == (
        "4a99557e4033c3539de2eb65472017cad5f9557f7a0625a09f1c3f6e2ba69c4c")
    assert sha256_hex("é") == hashlib.sha256("é".encode()).hexdigest()


# ------------------------------------------------- the stored identities built on it
SCHEMA = {"title": "Verdict", "type": "object",
          "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 9},
                         "why": {"type": "string", "minLength": 3}},
          "required": ["score", "why"]}
MESSAGES = [{"role": "system", "content": "Réponds en JSON."},
            {"role": "user", "content": "Évalue: 日本 🙂"}]
TOOLS = [{"type": "function", "function": {"name": "search",
                                           "parameters": {"type": "object"}}}]


def test_a_model_calls_record_key_is_pinned() -> None:
    from runtime.llm.request import request_hash, request_hashes

    assert request_hash("qwen3:0.6b", MESSAGES, SCHEMA, 256, False, TOOLS) == (
        "0f47878f1a950d0a30e61967e1b44351abdae9bff93032c18d0d6b6f5cb67d06")
    assert request_hashes(["qwen3:0.6b", "m2"], MESSAGES, None, 64, True) == {
        "qwen3:0.6b": "dbda1afc1ec03844ecd2d810cb09a4ad44ff2f5e697c9e4c356a030a18a30703",
        "m2": "20df1e16ee235414ae2592a52454f6499aeec38248c3bb08effa893f2b52d575"}


def test_the_stored_prompts_hashes_are_pinned() -> None:
    from runtime.llm.reply import request_text, schema_digest
    from runtime.llm.tool_loop import ToolRound, round_note

    assert schema_digest(SCHEMA) == "9123a3fc516dda1a"
    assert request_text("p", "s", SCHEMA) == (
        "[system]\ns\n\n[user]\np\n\n[format] json schema Verdict sha256:9123a3fc516dda1a")
    assert round_note(ToolRound(MESSAGES, TOOLS, 2)) == (
        "\n\n[tools] search; round 2 sha256:a097bd5c23694292")


def test_a_steps_arguments_and_the_offline_answer_are_pinned() -> None:
    from runtime.llm.backends.schema_instance import instance_for_schema

    args = {"args": [1, 2.5, datetime.date(2026, 1, 2)], "kwargs": {"q": "é"}}  # a step's
    assert canonical_json(args) == '{"args":[1,2.5,"2026-01-02"],"kwargs":{"q":"\\u00e9"}}'
    assert instance_for_schema(SCHEMA, "judge this") == {
        "score": 2, "why": "offline: judge this (why)"}


def test_a_datasets_version_and_a_task_requests_hash_are_pinned() -> None:
    from runtime.experiments.datasets import Case, version_of
    from runtime.store.rows import NewTask

    assert version_of([Case({"goal": "é", "expected": {"b": 1, "a": [1.5]}}, 0)]) == (
        "5da8189833df58c4")
    assert NewTask("ceo", "goal", {"goal": "é", "n": 1}).request_hash() == (
        "89ecd06f065c45c636e260259fad2f87d7c9dde4a75b165d6a0c255f449bf1e2")
