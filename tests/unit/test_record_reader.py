"""The model layer's batched look-ups of recorded replies (runtime.llm.ledger.RecordReader)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from runtime.llm.ledger import RecordReader
from runtime.records import RecordedCall, RecordLookup


def recorded(n: int) -> RecordedCall:
    return RecordedCall(call_id=n, request_hash=f"h{n}", response=f"reply {n}", thinking=None,
                        model="m", route="local", backend="offline", prompt_tokens=1,
                        completion_tokens=1)


class BatchedLedger:
    """Answers position ``p`` with record ``p`` (odd positions have none); counts reads."""

    def __init__(self) -> None:
        self.reads: list[int] = []
        self.lookups: list[RecordLookup] = []
        self.release = asyncio.Event()

    async def arecorded_calls(self, lookups: Sequence[RecordLookup]
                              ) -> list[RecordedCall | None]:
        await self.release.wait()  # the first read is slow: the others pile up behind it
        self.reads.append(len(lookups))
        self.lookups.extend(lookups)
        return [None if int(lk.position) % 2 else recorded(int(lk.position)) for lk in lookups]


def test_lookups_that_arrive_together_share_one_read_and_get_their_own_answers() -> None:
    ledger = BatchedLedger()
    reader = RecordReader(ledger)  # type: ignore[arg-type]  # only the read it makes
    task, twin = uuid.uuid4(), uuid.uuid4()

    async def main() -> list[RecordedCall | None]:
        calls = [reader.read(task, "run", str(p), ["h"], twin if p % 3 else None)
                 for p in range(40)]
        gathered = asyncio.gather(*calls)
        for _ in range(5):  # every call has queued its look-up
            await asyncio.sleep(0)
        ledger.release.set()
        return list(await gathered)

    answers = asyncio.run(main())
    assert [a.call_id if a else None for a in answers] == [
        None if p % 2 else p for p in range(40)]
    assert sum(ledger.reads) == 40 and len(ledger.reads) <= 2
    assert {(lk.position, lk.counterpart) for lk in ledger.lookups} == {
        (str(p), twin if p % 3 else None) for p in range(40)}


def test_a_failed_read_fails_each_of_its_callers() -> None:
    class Broken:
        async def arecorded_calls(self, lookups: Sequence[RecordLookup]) -> list[None]:
            raise ConnectionError("the database went away")

    reader = RecordReader(Broken())  # type: ignore[arg-type]

    async def main() -> list[BaseException | RecordedCall | None]:
        return list(await asyncio.gather(
            *(reader.read(uuid.uuid4(), "run", str(p), ["h"]) for p in range(3)),
            return_exceptions=True))

    assert all(isinstance(r, ConnectionError) for r in asyncio.run(main()))
