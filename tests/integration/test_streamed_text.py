"""Streamed text is recorded as it comes (issue 47, the write side): ``call_text``.

Real PostgreSQL, the loopback fake Ollama streaming NDJSON: pieces are written in order
with their offsets and put together they are the reply; a repaired or re-delivered call
is a new, higher attempt; a write whose lease is gone is refused; with ``[streaming]``
off nothing is written; a pruned tree's pieces go with it.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from runtime.config import Settings
from runtime.engine.charges import ChargeWriter
from runtime.engine.store_ledger import StoreLedger
from runtime.engine.text_writer import TextWriter
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.backends.ollama import OllamaBackend
from runtime.llm.handle import LLMFactory
from runtime.llm.reply import Backend
from runtime.llm.text_stream import CallAttempts
from runtime.store.rows import NewTask
from runtime.store.store import Store
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

PROMPT = "Say something long enough to come in several pieces, please."
LONG = "The quick brown fox jumps over the lazy dog, and then over the lazy cat too."


class Answer(BaseModel):
    text: str


@pytest.fixture
def text_writer(store: Store) -> Iterator[TextWriter]:
    """A text writer with a short window, so a slow stream is written in several pieces."""
    writer = TextWriter(store, flush_seconds=0.02, flush_chars=10_000)
    yield writer
    writer.close()


@pytest.fixture
def charges(store: Store) -> Iterator[ChargeWriter]:
    writer = ChargeWriter(store)
    yield writer
    writer.close()


def _claimed(store: Store) -> Any:
    store.tasks.submit(NewTask(to_agent="scout", type="task", payload={"goal": "g"}))
    (row,) = store.claims.claim(["scout"], 1, "w", 30)
    return row


def _factory(store: Store, charges: ChargeWriter, backend: Backend,
             text: TextWriter | None) -> LLMFactory:
    return LLMFactory(Settings(), StoreLedger(store, charges), backend=backend,
                      announcement="test", text=text)


def _pieces(store: Store, task_id: uuid.UUID) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text(
            'SELECT root_id, phase, call_index, attempt, "offset", text, lease_token, '
            "txid::text AS txid FROM call_text WHERE task_id = :id "
            'ORDER BY call_index, attempt, "offset"'), {"id": task_id}).mappings().all()
    return [dict(r) for r in rows]


def _text_of(pieces: list[dict[str, Any]], attempt: int) -> str:
    mine = [p for p in pieces if p["attempt"] == attempt]
    offset = 0
    for p in mine:  # contiguous: each piece starts where the one before ended
        assert p["offset"] == offset
        offset += len(p["text"])
    return "".join(p["text"] for p in mine)


def test_ollama_pieces_are_recorded_in_order_and_make_the_reply(
        store: Store, charges: ChargeWriter, text_writer: TextWriter,
        fake_ollama: FakeOllama) -> None:
    fake_ollama.reply_text = LONG
    fake_ollama.piece_chars = 5
    fake_ollama.piece_delay_seconds = 0.02  # 16 pieces over 0.3 s, windows of 0.02 s
    row = _claimed(store)
    llm = _factory(store, charges, OllamaBackend(fake_ollama.url, 10.0), text_writer) \
        .for_task(row, row["lease_token"], threading.Event())
    reply = llm.complete(PROMPT)
    assert fake_ollama.requests[-1]["stream"] is True
    assert reply.text == LONG
    pieces = _pieces(store, row["id"])
    assert len(pieces) >= 3  # written as it came, not once at the end
    assert {(p["phase"], p["call_index"], p["attempt"]) for p in pieces} == {("run", 0, 1)}
    assert _text_of(pieces, 1) == reply.text
    assert {p["root_id"] for p in pieces} == {row["root_id"]}
    assert {p["lease_token"] for p in pieces} == {row["lease_token"]}
    # The model_calls row is the reply, recorded on arrival as without streaming.
    (call,) = store.reads.model_calls(row["id"])
    assert call["response"] == reply.text and call["call_index"] == 0


@pytest.mark.timeout(60)
def test_every_piece_is_committed_before_the_call_returns(
        store: Store, charges: ChargeWriter, fake_ollama: FakeOllama) -> None:
    # A window of an hour: only the end of the reply makes the writer write at once (a
    # writer that waited for the window would hold the call past the test's timeout).
    writer = TextWriter(store, flush_seconds=3600.0, flush_chars=10_000)
    try:
        fake_ollama.reply_text = LONG
        row = _claimed(store)
        reply = _factory(store, charges, OllamaBackend(fake_ollama.url, 10.0), writer) \
            .for_task(row, row["lease_token"], threading.Event()).complete(PROMPT)
        assert _text_of(_pieces(store, row["id"]), 1) == reply.text
    finally:
        writer.close()


def test_a_repaired_call_streams_a_new_higher_attempt(
        store: Store, charges: ChargeWriter, text_writer: TextWriter,
        fake_ollama: FakeOllama) -> None:
    fake_ollama.script = ["broken_json", "ok"]
    row = _claimed(store)
    llm = _factory(store, charges, OllamaBackend(fake_ollama.url, 10.0), text_writer) \
        .for_task(row, row["lease_token"], threading.Event())
    reply = llm.complete(PROMPT, schema=Answer)
    pieces = _pieces(store, row["id"])
    assert sorted({p["attempt"] for p in pieces}) == [1, 2]
    calls = store.reads.model_calls(row["id"])
    assert _text_of(pieces, 1) == calls[0]["response"]  # the broken reply, as it came
    assert _text_of(pieces, 2) == reply.text == calls[1]["response"]


def test_a_redelivered_call_is_a_new_attempt_and_the_old_lease_is_refused(
        store: Store, text_writer: TextWriter) -> None:
    row = _claimed(store)
    old_token = row["lease_token"]
    first = text_writer.open(row["id"], old_token, "run", 0, CallAttempts())
    first.add("half of a reply, cut off by")
    _wait_written(first)
    assert first.attempt == 1
    # The task is taken back and delivered again (a new lease token).
    new_token = uuid.uuid4()
    with store.database.transaction() as conn:
        conn.execute(sa.text("UPDATE tasks SET lease_token = :new WHERE id = :id"),
                     {"new": new_token, "id": row["id"]})
    first.add(" a crash")  # the old delivery's late piece: refused
    _wait_until(lambda: first.refused)
    second = text_writer.open(row["id"], new_token, "run", 0, CallAttempts())
    second.add("the whole reply, again")
    _wait_written(second)
    assert second.attempt == 2
    pieces = _pieces(store, row["id"])
    assert [(p["attempt"], p["offset"], p["text"], p["lease_token"]) for p in pieces] == [
        (1, 0, "half of a reply, cut off by", old_token),
        (2, 0, "the whole reply, again", new_token)]
    # A stream opened under the old token writes nothing at all.
    stale = text_writer.open(row["id"], old_token, "run", 0, CallAttempts())
    stale.add("from a worker that does not know yet")
    _wait_until(lambda: stale.refused)
    assert len(_pieces(store, row["id"])) == 2


def test_a_write_is_not_stored_twice(store: Store) -> None:
    """The same piece written again (an in-doubt COMMIT retried) stays one row."""
    from runtime.store.call_text import TextPiece

    row = _claimed(store)
    token = row["lease_token"]
    first = TextPiece(row["id"], token, "run", 3, None, 0, 0, "hello ")
    (a,) = store.call_text.write([first])
    (again,) = store.call_text.write([first])  # the COMMIT had landed: same attempt, ours
    assert (a.fenced, a.attempt, a.ours) == (True, 1, True)
    assert (again.fenced, again.attempt, again.ours) == (True, 1, True)
    (b,) = store.call_text.write([TextPiece(row["id"], token, "run", 3, 1, 1, 6, "world")])
    (b2,) = store.call_text.write([TextPiece(row["id"], token, "run", 3, 1, 1, 6, "world")])
    assert b.ours and b2.ours
    # The call's next stream of this delivery gets the next attempt.
    (c,) = store.call_text.write([TextPiece(row["id"], token, "run", 3, None, 1, 0, "x")])
    assert c.attempt == 2
    assert [(p["attempt"], p["offset"], p["text"]) for p in _pieces(store, row["id"])] == [
        (1, 0, "hello "), (1, 6, "world"), (2, 0, "x")]


def test_offline_calls_stream_in_pieces_too(store: Store, charges: ChargeWriter) -> None:
    writer = TextWriter(store, flush_seconds=0.02, flush_chars=4)
    try:
        row = _claimed(store)
        llm = _factory(store, charges, OfflineBackend(), writer).for_task(
            row, row["lease_token"], threading.Event())
        first = llm.complete(PROMPT)
        second = llm.complete(PROMPT + " again", schema=Answer)
        pieces = _pieces(store, row["id"])
        assert {p["call_index"] for p in pieces} == {0, 1}
        assert _text_of([p for p in pieces if p["call_index"] == 0], 1) == first.text
        assert _text_of([p for p in pieces if p["call_index"] == 1], 1) == second.text
    finally:
        writer.close()


def test_streaming_off_writes_nothing_and_asks_ollama_not_to_stream(
        store: Store, charges: ChargeWriter, fake_ollama: FakeOllama) -> None:
    row = _claimed(store)
    reply = _factory(store, charges, OllamaBackend(fake_ollama.url, 10.0), None).for_task(
        row, row["lease_token"], threading.Event()).complete(PROMPT)
    assert reply.text and fake_ollama.requests[-1]["stream"] is False
    assert _pieces(store, row["id"]) == []


def test_the_runtime_streams_only_when_the_setting_says_so(db_url: str, store: Store) -> None:
    from runtime.wiring import build_runtime

    on = build_runtime(Settings.model_validate({"database": {"url": db_url},
                                                "llm": {"backend": "offline"}}), store=store)
    off = build_runtime(Settings.model_validate({"database": {"url": db_url},
                                                 "llm": {"backend": "offline"},
                                                 "streaming": {"enabled": False}}),
                        store=store)
    assert isinstance(on.llm_factory.text, TextWriter)
    assert off.llm_factory.text is None


def test_a_stream_cut_off_mid_reply_keeps_what_came_and_the_retry_is_a_new_attempt(
        store: Store, charges: ChargeWriter, text_writer: TextWriter,
        fake_ollama: FakeOllama) -> None:
    fake_ollama.reply_text = LONG
    fake_ollama.piece_chars = 10
    fake_ollama.cut_after_pieces = 3
    fake_ollama.cuts = 1  # the first reply is cut off, the retry is whole
    row = _claimed(store)
    llm = _factory(store, charges, OllamaBackend(fake_ollama.url, 10.0), text_writer) \
        .for_task(row, row["lease_token"], threading.Event())
    reply = llm.complete(PROMPT)
    pieces = _pieces(store, row["id"])
    assert _text_of(pieces, 1) == LONG[:30]  # what came before the cut, once
    assert _text_of(pieces, 2) == reply.text == LONG


def test_a_pruned_tree_takes_its_pieces_with_it(
        store: Store, charges: ChargeWriter, text_writer: TextWriter) -> None:
    row = _claimed(store)
    llm = _factory(store, charges, OfflineBackend(), text_writer).for_task(
        row, row["lease_token"], threading.Event())
    llm.complete(PROMPT)
    assert _pieces(store, row["id"])
    with store.database.transaction() as conn:  # the tree ends (as an outcome would leave it)
        conn.execute(sa.text("UPDATE tasks SET status = 'done', lease_token = NULL, "
                             "completed_at = now() - interval '2 days' WHERE id = :id"),
                     {"id": row["id"]})
    assert store.reads.prune(dt.timedelta(days=1)) == (1, 1)
    assert _pieces(store, row["id"]) == []


def _wait_until(done: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _wait_written(stream: Any) -> None:
    _wait_until(lambda: stream.attempt is not None and not stream.has_pending()
                and stream.written == stream.offset)


@pytest.fixture
def embedded() -> Iterator[Any]:
    """The embedded model (the test skips without it), closed after the test."""
    from runtime.llm.backends.embedded import (
        EmbeddedBackend,
        default_model_path,
        extra_installed,
    )

    if not extra_installed() or default_model_path() is None:
        pytest.skip("the embedded extra is not installed ('make install-embedded')")
    backend = EmbeddedBackend(Settings().embedded)
    yield backend
    backend.close()


def test_the_embedded_model_streams_token_by_token(
        store: Store, charges: ChargeWriter, embedded: Any) -> None:
    backend = embedded
    writer = TextWriter(store, flush_seconds=0.01, flush_chars=10_000)
    try:
        row = _claimed(store)
        llm = _factory(store, charges, backend, writer).for_task(
            row, row["lease_token"], threading.Event())
        reply = llm.complete("Write three sentences about durable queues.", max_tokens=60)
        structured = llm.complete("Name a durable runtime.", schema=Answer, max_tokens=40)
        pieces = _pieces(store, row["id"])
        assert len([p for p in pieces if p["call_index"] == 0]) >= 2  # as it came
        assert _text_of([p for p in pieces if p["call_index"] == 0], 1) == reply.text
        assert _text_of([p for p in pieces if p["call_index"] == 1], 1) == structured.text
    finally:
        writer.close()


def test_a_call_cut_off_mid_generation_continues_from_its_recorded_text(
        store: Store, charges: ChargeWriter, embedded: Any) -> None:
    """The embedded model continues a prefix: only what came after the last piece is made."""
    from tests.factories import hand_over

    backend = embedded
    writer = TextWriter(store, flush_seconds=0.01, flush_chars=10_000)
    try:
        row = _claimed(store)
        # The first delivery streamed the start of its reply, then its worker died.
        dead = writer.open(row["id"], row["lease_token"], "run", 0, CallAttempts())
        dead.add("Durable queues keep every job in a table, so")
        _wait_written(dead)
        token = hand_over(store, row["id"])  # taken back, delivered again
        again = store.reads.get(row["id"])
        llm = _factory(store, charges, backend, writer).for_task(again, token,
                                                                 threading.Event())
        reply = llm.complete("Write two sentences about durable queues.", max_tokens=40)
        assert reply.text.startswith("Durable queues keep every job in a table, so")
        assert len(reply.text) > len("Durable queues keep every job in a table, so")
        pieces = _pieces(store, row["id"])
        assert {p["attempt"] for p in pieces} == {1}  # the same attempt, continued
        assert _text_of(pieces, 1) == reply.text
        assert {p["lease_token"] for p in pieces} == {row["lease_token"], token}
        (call,) = store.reads.model_calls(row["id"])
        assert call["response"] == reply.text
        # Its start was evaluated as prompt and counts as completion too (never charged).
        assert call["completion_tokens"] > backend.count_tokens(
            "Durable queues keep every job in a table, so")
        # A later call of the same delivery starts from nothing.
        other = llm.complete("Name a durable runtime.", max_tokens=20)
        assert not other.text.startswith("Durable queues keep")
    finally:
        writer.close()


def test_an_ollama_call_cut_off_continues_as_the_assistants_last_message(
        store: Store, charges: ChargeWriter, text_writer: TextWriter,
        fake_ollama: FakeOllama) -> None:
    from tests.factories import hand_over

    row = _claimed(store)
    dead = text_writer.open(row["id"], row["lease_token"], "run", 0, CallAttempts())
    dead.add("The first half,")
    _wait_written(dead)
    token = hand_over(store, row["id"])
    fake_ollama.reply_text = " and the second."  # what the model adds after the prefix
    llm = _factory(store, charges, OllamaBackend(fake_ollama.url, 10.0), text_writer) \
        .for_task(store.reads.get(row["id"]), token, threading.Event())
    reply = llm.complete(PROMPT)
    sent = fake_ollama.requests[-1]["messages"]
    assert sent[-1] == {"role": "assistant", "content": "The first half,"}
    assert reply.text == "The first half, and the second."
    pieces = _pieces(store, row["id"])
    assert {p["attempt"] for p in pieces} == {1}
    assert _text_of(pieces, 1) == reply.text
    # A structured call is never continued: its grammar (format) starts over.
    dead2 = text_writer.open(row["id"], token, "run", 1, CallAttempts())
    dead2.add('{"te')
    _wait_written(dead2)
    token2 = hand_over(store, row["id"])
    fake_ollama.reply_text = None
    llm2 = _factory(store, charges, OllamaBackend(fake_ollama.url, 10.0), text_writer) \
        .for_task(store.reads.get(row["id"]), token2, threading.Event())
    llm2.complete(PROMPT)  # call 0: replayed from the record (no request)
    structured = llm2.complete(PROMPT + " as JSON", schema=Answer)
    assert fake_ollama.requests[-1]["messages"][-1]["role"] == "user"
    assert _text_of([p for p in _pieces(store, row["id"]) if p["call_index"] == 1],
                    2) == structured.text


def test_with_continuing_off_a_call_cut_off_is_made_again_as_a_new_attempt(
        store: Store, charges: ChargeWriter, text_writer: TextWriter,
        fake_ollama: FakeOllama) -> None:
    from tests.factories import hand_over

    row = _claimed(store)
    dead = text_writer.open(row["id"], row["lease_token"], "run", 0, CallAttempts())
    dead.add("The first half,")
    _wait_written(dead)
    token = hand_over(store, row["id"])
    settings = Settings.model_validate({"streaming": {"continue_cut_off": False}})
    factory = LLMFactory(settings, StoreLedger(store, charges),
                         backend=OllamaBackend(fake_ollama.url, 10.0), announcement="test",
                         text=text_writer)
    reply = factory.for_task(store.reads.get(row["id"]), token, threading.Event()).complete(PROMPT)
    assert fake_ollama.requests[-1]["messages"][-1]["role"] == "user"
    pieces = _pieces(store, row["id"])
    assert _text_of(pieces, 1) == "The first half,"  # superseded, kept
    assert _text_of(pieces, 2) == reply.text
