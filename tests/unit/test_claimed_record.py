"""A branch task's calls matched against the counterpart's replies its claim carried.

``claimed_record`` must find what ``model_call_get_recorded_many`` finds in the
counterpart's record (same position, the request's hash for one of the candidate
models, the newest row), hashing the request per model only as needed.
"""

from __future__ import annotations

from typing import Any

from runtime.llm.recorded import claimed_record
from runtime.llm.request import Request

MODELS = ("local-model", "cloud-model")


def request(prompt: str = "write part 1", position: str = "0") -> Request:
    return Request(prompt, None, None, None, 64, False, 0, position)


def row(call_id: int, model: str, request_hash: str, position: str = "0") -> dict[str, Any]:
    return {"id": call_id, "position": position, "request_hash": request_hash,
            "response": f"reply {call_id}", "thinking": None, "model": model,
            "route": "local", "backend": "ollama", "prompt_tokens": 3,
            "completion_tokens": 4, "tool_calls": None}


def test_a_replayed_call_hashes_its_request_for_the_rows_model_only() -> None:
    call = request()
    local = request().hashes(MODELS)["local-model"]
    found = claimed_record([row(7, "local-model", local)], call, MODELS)
    assert found is not None and found.call_id == 7 and found.response == "reply 7"
    assert call.record_keys == {"local-model": local}


def test_the_newest_matching_row_at_the_position_answers() -> None:
    hashes = request().hashes(MODELS)
    rows = [row(3, "local-model", hashes["local-model"]),
            row(9, "cloud-model", hashes["cloud-model"]),
            row(12, "local-model", hashes["local-model"], position="1")]
    found = claimed_record(rows, request(), MODELS)
    assert found is not None and found.call_id == 9


def test_a_changed_request_or_another_position_is_not_replayed() -> None:
    hashes = request().hashes(MODELS)
    rows = [row(3, "local-model", hashes["local-model"])]
    changed = request("write part 2")
    assert claimed_record(rows, changed, MODELS) is None
    assert changed.record_keys == changed.hashes(MODELS)  # every candidate was compared
    elsewhere = request(position="key:intro")
    assert claimed_record(rows, elsewhere, MODELS) is None
    assert elsewhere.record_keys == {}  # nothing at that position: nothing hashed


def test_a_row_naming_another_model_than_it_was_hashed_for_still_matches() -> None:
    hashes = request().hashes(MODELS)
    rows = [row(5, "some-gguf-name", hashes["cloud-model"])]
    found = claimed_record(rows, request(), MODELS)
    assert found is not None and found.call_id == 5
