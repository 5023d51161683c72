"""A model call's reply is durable the moment it arrives, before it is validated (issue 44).

The reply's ``model_calls`` row is queued to the charge writer as soon as the backend has
parsed it (``runtime/llm/arrival.py``), so it is committed while the call's later stages
(validation, repair, the budget, the agent) still run; a reply that then fails
validation keeps its row and its charge, and the row gets its error.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel, field_validator

from runtime.config import Settings
from runtime.engine.charges import ChargeWriter
from runtime.engine.store_ledger import StoreLedger
from runtime.llm.backends.ollama import OllamaBackend
from runtime.llm.handle import LLMFactory
from runtime.store.rows import NewTask
from runtime.store.store import Store
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

PROMPT = "Name one durable runtime."
#: How long a validator waits for the reply's row to be committed.
ROW_WAIT_SECONDS = 5.0


@pytest.fixture
def writer(store: Store) -> Iterator[ChargeWriter]:
    """The worker's group-committing charge writer, on the test's store."""
    charges = ChargeWriter(store)
    yield charges
    charges.close()


def _claimed(store: Store) -> dict[str, Any]:
    store.tasks.submit(NewTask(to_agent="scout", type="task", payload={"goal": "g"}))
    (row,) = store.claims.claim(["scout"], 1, "w", 30)
    return row


def _factory(store: Store, writer: ChargeWriter, fake: FakeOllama) -> LLMFactory:
    return LLMFactory(Settings(), StoreLedger(store, writer),
                      backend=OllamaBackend(fake.url, 10.0), announcement="test")


def _rows(store: Store, task_id: uuid.UUID) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM model_calls WHERE task_id = :id"),
                                {"id": task_id}).scalar_one())


def test_a_reply_is_on_record_before_it_is_validated(
        store: Store, writer: ChargeWriter, fake_ollama: FakeOllama) -> None:
    row = _claimed(store)
    rows_at_validation: list[int] = []

    class Checked(BaseModel):
        text: str

        @field_validator("text")
        @classmethod
        def seen_on_record(cls, value: str) -> str:
            # Validation holds the call's loop; the writer commits on its own thread.
            deadline = time.monotonic() + ROW_WAIT_SECONDS
            while _rows(store, row["id"]) == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            rows_at_validation.append(_rows(store, row["id"]))
            return value

    llm = _factory(store, writer, fake_ollama).for_task(row, row["lease_token"],
                                                         threading.Event())
    reply = llm.complete(PROMPT, schema=Checked)
    # (Validated again when the agent's output is built: the row is there then too.)
    assert rows_at_validation[0] == 1
    (call,) = store.reads.model_calls(row["id"])
    assert call["error"] is None and call["response"] == reply.text
    assert (store.reads.get(row["id"])["spent_tokens"]
            == reply.prompt_tokens + reply.completion_tokens)


def test_a_reply_that_fails_validation_keeps_its_charge_and_gets_its_error(
        store: Store, writer: ChargeWriter, fake_ollama: FakeOllama) -> None:
    row = _claimed(store)
    validated: list[str] = []

    class Picky(BaseModel):
        text: str

        @field_validator("text")
        @classmethod
        def second_time_lucky(cls, value: str) -> str:
            validated.append(value)
            if len(validated) == 1:
                raise ValueError("not good enough yet")
            return value

    factory = _factory(store, writer, fake_ollama)
    reply = factory.for_task(row, row["lease_token"], threading.Event()).complete(
        PROMPT, schema=Picky)
    calls = store.reads.model_calls(row["id"])
    assert [(c["attempt_kind"], c["call_try"]) for c in calls] == [("call", 1), ("repair", 2)]
    assert calls[0]["error"].startswith("BadModelReply: ") and "not good enough yet" in \
        calls[0]["error"]
    assert calls[1]["error"] is None and calls[1]["response"] == reply.text
    # Both requests were paid for, once each: the bad reply's charge stays.
    assert store.reads.get(row["id"])["spent_tokens"] == sum(
        c["prompt_tokens"] + c["completion_tokens"] for c in calls)
    assert reply.cost_usd == sum(c["cost_usd"] for c in calls) and reply.attempts == 2
    # Another delivery of the task replays the good reply, not the bad one.
    asked = fake_ollama.received
    again = factory.for_task(store.reads.get(row["id"]), row["lease_token"], threading.Event())
    replayed = again.complete(PROMPT, schema=Picky)
    assert replayed.replayed and replayed.text == reply.text
    assert fake_ollama.received == asked
