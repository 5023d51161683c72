"""Replayed calls' rows held for a task's outcome (runtime.llm.call_records.HeldReplays)."""

from __future__ import annotations

import threading
import uuid
from decimal import Decimal
from typing import Any

from runtime.llm.call_records import HeldReplays, Rows, defer_replays, held_replays
from runtime.llm.reply import ModelReply
from runtime.llm.request import CallProgress, Request
from runtime.llm.routing import Route, Routed
from runtime.store.rows import ModelCharge


class Ledger:
    def __init__(self) -> None:
        self.charged: list[ModelCharge] = []

    def charge(self, charge: ModelCharge) -> bool:
        self.charged.append(charge)
        return True


class Handle:
    """What a task's model handle offers the executor: its ``replays``."""

    def __init__(self, ledger: Ledger, lost: threading.Event) -> None:
        self.replays = HeldReplays(ledger, lost)


def replayed_call(position: str = "0") -> tuple[Rows, CallProgress, ModelReply]:
    rows = Rows(uuid.uuid4(), uuid.uuid4(), 2, "ollama", "run", record=True)
    call = CallProgress.start(
        Request("the prompt", None, None, None, 100, False, 0, position),
        Routed(Route("local", "qwen3:1.7b", "replayed from model call 7"), Decimal(0),
               "hash-" + position, "the prompt"))
    reply = ModelReply("the answer", None, 0, 0, 0.0, "qwen3:1.7b", "ollama")
    return rows, call, reply


def test_rows_are_written_at_once_unless_deferred() -> None:
    handle = Handle(Ledger(), threading.Event())
    assert not handle.replays.hold(*replayed_call())
    assert held_replays(handle, True) == []


def test_held_rows_go_with_the_outcome_once() -> None:
    ledger = Ledger()
    handle = defer_replays(Handle(ledger, threading.Event()))
    assert handle.replays.hold(*replayed_call("0")) and handle.replays.hold(*replayed_call("1"))
    records = held_replays(handle, True)
    assert [r["position"] for r in records] == ["0", "1"]
    first: dict[str, Any] = records[0]
    assert (first["attempt"], first["request_hash"], first["response"], first["model"]) == (
        2, "hash-0", "the answer", "qwen3:1.7b")
    assert first["at"] and ledger.charged == []
    assert held_replays(handle, True) == []  # taken: never carried twice


def test_an_outcome_that_cannot_carry_them_writes_them_now() -> None:
    ledger = Ledger()
    handle = defer_replays(Handle(ledger, threading.Event()))
    handle.replays.hold(*replayed_call())
    assert held_replays(handle, False) == []
    (charge,) = ledger.charged
    assert charge.replayed and charge.call_try == 0 and charge.cost_usd == 0
    assert charge.prompt_tokens == charge.completion_tokens == 0


def test_nothing_is_written_once_the_lease_is_lost() -> None:
    ledger, lost = Ledger(), threading.Event()
    handle = defer_replays(Handle(ledger, lost))
    handle.replays.hold(*replayed_call())
    lost.set()
    held_replays(handle, False)
    assert ledger.charged == []
