"""A task's next delivery adopts its journaled replies once, batched with other tasks'.

``RecordReader.adopt`` shares one ``aadopt_replies`` among the adoptions asked for
together; ``RecordedReplies`` of a redelivered task (``delivery_count`` above 1) adopts
once before its first look-up, however many of its calls ask at once; a first delivery
adopts nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from runtime.llm.ledger import RecordReader
from runtime.llm.recorded import RecordedReplies
from runtime.records import RecordedCall, RecordLookup


class Ledger:
    """Records the adoptions and look-ups asked of it; finds nothing on record."""

    def __init__(self) -> None:
        self.adoptions: list[list[tuple[uuid.UUID, uuid.UUID]]] = []
        self.lookups = 0

    async def aadopt_replies(self, tasks: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> int:
        await asyncio.sleep(0)
        self.adoptions.append(list(tasks))
        return 0

    async def arecorded_calls(self, lookups: Sequence[RecordLookup]
                              ) -> list[RecordedCall | None]:
        self.lookups += len(lookups)
        return [None for _ in lookups]


def test_adoptions_asked_together_share_one_statement() -> None:
    ledger = Ledger()
    reader = RecordReader(ledger)  # type: ignore[arg-type]  # only what it calls
    tasks = [(uuid.uuid4(), uuid.uuid4()) for _ in range(30)]

    async def main() -> None:
        await asyncio.gather(*(reader.adopt(task, token) for task, token in tasks))

    asyncio.run(main())
    assert sorted(t for batch in ledger.adoptions for t in batch) == sorted(tasks)
    assert len(ledger.adoptions) == 1


class _Rows:
    def __init__(self) -> None:
        self.task_id, self.lease_token = uuid.uuid4(), uuid.uuid4()


class _Charger:
    def __init__(self) -> None:
        self.rows = _Rows()


class _Request:
    position = "0"

    def keys_for(self, models: Sequence[str]) -> dict[str, str]:
        return {m: f"h-{m}" for m in models}


def _replies(ledger: Ledger, deliveries: int) -> tuple[RecordedReplies, _Charger]:
    settings: Any = type("S", (), {})()
    settings.llm = type("L", (), {"durable": True, "record": True})()
    settings.models = type("M", (), {"local": "small", "cloud": "big"})()
    charger = _Charger()
    replies = RecordedReplies(settings, RecordReader(ledger),  # type: ignore[arg-type]
                              {"delivery_count": deliveries, "recorded_calls": False},
                              "run", charger, None, False)  # type: ignore[arg-type]
    return replies, charger


def test_a_redelivered_task_adopts_once_before_its_look_ups() -> None:
    ledger = Ledger()
    replies, charger = _replies(ledger, 2)

    async def main() -> list[Any]:
        return list(await asyncio.gather(
            *(replies.answer(_Request()) for _ in range(3))))  # type: ignore[arg-type]

    assert asyncio.run(main()) == [None, None, None]
    assert ledger.adoptions == [[(charger.rows.task_id, charger.rows.lease_token)]]
    assert ledger.lookups == 3  # each call looked the record up after the adoption
    asyncio.run(main())
    assert len(ledger.adoptions) == 1


def test_a_first_delivery_with_nothing_on_record_neither_adopts_nor_looks_up() -> None:
    ledger = Ledger()
    replies, _ = _replies(ledger, 1)
    assert asyncio.run(replies.answer(_Request())) is None  # type: ignore[arg-type]
    assert ledger.adoptions == [] and ledger.lookups == 0
