"""A model call's reply is durable the moment it arrives, before it is validated (issue 44).

The reply's ``model_calls`` row is queued to the charge writer as soon as the backend has
parsed it (``runtime/llm/arrival.py``), so it is committed while the call's later stages
(validation, repair, the budget, the agent) still run; a reply that then fails
validation keeps its row and its charge, and the row gets its error.

Each test runs twice: calls made outside a worker (read in this process), and calls of a
worker's attached loop, made and recorded by its recorder process
(``runtime/llm/recorder.py``), whose errors reach the caller as their own class and which
ends when the worker detaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
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
from runtime.errors import ModelNotFound
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


@pytest.fixture(params=[False, True], ids=["in-process", "recorder"])
def attached(request: pytest.FixtureRequest) -> bool:
    """Whether the factory's calls run on a worker's attached loop (its recorder process)."""
    return bool(request.param)


@contextlib.contextmanager
def _worker_loop(factory: LLMFactory) -> Iterator[None]:
    """A loop in a thread, attached to ``factory`` as a worker's is, detached at the end."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    factory.attach(loop)
    try:
        yield
    finally:
        asyncio.run_coroutine_threadsafe(factory.detach(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture
def factory(store: Store, writer: ChargeWriter, fake_ollama: FakeOllama,
            attached: bool) -> Iterator[LLMFactory]:
    """The model layer over the fake server, attached to a worker's loop or not."""
    made = LLMFactory(Settings(), StoreLedger(store, writer),
                      backend=OllamaBackend(fake_ollama.url, 10.0), announcement="test")
    if not attached:
        yield made
        return
    with _worker_loop(made):
        recorder = made.recorder()
        assert recorder is not None and recorder.pid not in (None, os.getpid())
        yield made


def _rows(store: Store, task_id: uuid.UUID) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM model_calls WHERE task_id = :id"),
                                {"id": task_id}).scalar_one())


def test_a_reply_is_on_record_before_it_is_validated(store: Store,
                                                    factory: LLMFactory) -> None:
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

    llm = factory.for_task(row, row["lease_token"], threading.Event())
    reply = llm.complete(PROMPT, schema=Checked)
    # (Validated again when the agent's output is built: the row is there then too.)
    assert rows_at_validation[0] == 1
    (call,) = store.reads.model_calls(row["id"])
    assert call["error"] is None and call["response"] == reply.text
    assert (store.reads.get(row["id"])["spent_tokens"]
            == reply.prompt_tokens + reply.completion_tokens)


def test_a_reply_that_fails_validation_keeps_its_charge_and_gets_its_error(
        store: Store, factory: LLMFactory, fake_ollama: FakeOllama) -> None:
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


def test_an_error_reaches_the_caller_as_its_own_class(
        store: Store, factory: LLMFactory, fake_ollama: FakeOllama) -> None:
    row = _claimed(store)
    fake_ollama.models = []  # every model is missing: 404
    llm = factory.for_task(row, row["lease_token"], threading.Event())
    with pytest.raises(ModelNotFound, match="not found on the model server"):
        llm.complete(PROMPT)
    (call,) = store.reads.model_calls(row["id"])
    assert call["error"].startswith("ModelNotFound: ")


def test_the_recorder_process_ends_when_the_worker_detaches(
        store: Store, writer: ChargeWriter, fake_ollama: FakeOllama) -> None:
    made = LLMFactory(Settings(), StoreLedger(store, writer),
                      backend=OllamaBackend(fake_ollama.url, 10.0), announcement="test")
    with _worker_loop(made):
        recorder = made.recorder()
        assert recorder is not None
        pid = recorder.pid
        assert pid is not None
        row = _claimed(store)
        made.for_task(row, row["lease_token"], threading.Event()).complete(PROMPT)
    assert made.recorder() is None and recorder.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: gone
