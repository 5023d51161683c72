"""The model layer's batched look-ups of recorded replies (runtime.llm.ledger.RecordReader)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from runtime.llm.ledger import RecordedCall, RecordLookup, RecordReader


def recorded(n: int) -> RecordedCall:
    return RecordedCall(call_id=n, request_hash=f"h{n}", response=f"reply {n}", thinking=None,
                        model="m", route="local", backend="offline", prompt_tokens=1,
                        completion_tokens=1)


class BatchedLedger:
    """Answers position ``p`` with record ``p`` (odd positions have none); counts reads."""

    def __init__(self) -> None:
        self.reads: list[int] = []
        self.release = threading.Event()

    def recorded_calls(self, lookups: Sequence[RecordLookup]) -> list[RecordedCall | None]:
        self.release.wait(5)  # the first read is slow: the others pile up behind it
        self.reads.append(len(lookups))
        return [None if int(lk.position) % 2 else recorded(int(lk.position)) for lk in lookups]


async def off_loop(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


def test_lookups_that_arrive_together_share_one_read_and_get_their_own_answers() -> None:
    ledger = BatchedLedger()
    reader = RecordReader(ledger, off_loop)
    task, twin = uuid.uuid4(), uuid.uuid4()

    async def main() -> list[RecordedCall | None]:
        calls = [reader.read(task, "run", str(p), ["h"], twin) for p in range(40)]
        gathered = asyncio.gather(*calls)
        await asyncio.sleep(0.05)
        ledger.release.set()
        return list(await gathered)

    answers = asyncio.run(main())
    assert [a.call_id if a else None for a in answers] == [
        None if p % 2 else p for p in range(40)]
    assert sum(ledger.reads) == 40 and len(ledger.reads) <= 2


class SingleLedger:
    """A ledger without the batched read: one ``recorded_call`` per look-up."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def recorded_call(self, *args: Any) -> RecordedCall | None:
        self.calls.append(args)
        return recorded(7)


def test_a_ledger_without_batched_reads_is_asked_once_per_lookup() -> None:
    ledger = SingleLedger()
    reader = RecordReader(ledger, off_loop)
    task, twin = uuid.uuid4(), uuid.uuid4()

    async def main() -> None:
        await reader.read(task, "run", "0", ["h"])
        await reader.read(task, "run", "1", ["h"], twin)

    asyncio.run(main())
    assert ledger.calls == [(task, "run", "0", ["h"]), (task, "run", "1", ["h"], twin)]
