"""The model layer's :class:`~runtime.llm.ledger.CallLedger` over the Store, all of it.

Charges go through a :class:`~runtime.engine.charges.ChargeWriter` when one is given, so
the charges of many calls in flight are written in batches (one guarded statement per
batch); without one, each charge is its own transaction.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from runtime.engine.charges import ChargeWriter
from runtime.engine.step_writer import AsyncStepWriter, psycopg_sql
from runtime.jsoncodec import dumps_fast
from runtime.llm.ledger import CallLedger
from runtime.records import (
    ModelCharge,
    RecordedCall,
    RecordLookup,
    StepBegin,
    StepEnd,
    StepRecord,
)
from runtime.store.call_replies import CallReplies
from runtime.store.queries import QUERIES
from runtime.store.store import Store

_RECORDED_MANY = psycopg_sql(QUERIES["model_call_get_recorded_many"])


class StoreLedger(CallLedger):
    """Queue depth, charges, the record of replies and durable steps, through a Store.

    It names :class:`~runtime.llm.ledger.CallLedger` as its base so that mypy checks it
    implements every method of the protocol, with the protocol's signatures.
    """

    def __init__(self, store: Store, writer: ChargeWriter | None = None) -> None:
        self.store = store
        self.writer = writer
        #: Charges queued without a writer (tests, tools): each one its own transaction.
        self._charges = ThreadPoolExecutor(max_workers=4, thread_name_prefix="charge")
        #: Steps' writes from coroutines: the loop's own async connections (no thread hop).
        self.step_writer = AsyncStepWriter(
            store.engine.url.render_as_string(hide_password=False))
        #: The journal of replies the recorder process writes on arrival.
        self.replies = CallReplies(store.engine)

    def pending_depth(self) -> int:
        """How many tasks are pending (the model layer caches it for routing)."""
        return self.store.reads.pending_depth()

    def charges_url(self) -> str | None:
        """The store's database, with its password (for the recorder process)."""
        return self.store.engine.url.render_as_string(hide_password=False)

    def charge(self, charge: ModelCharge) -> bool:
        """Record and charge one model call row; False when the task's lease is gone."""
        if self.writer is not None:
            return self.writer.charge(charge)
        return self.store.spend.charge(charge)

    async def acharge(self, charge: ModelCharge) -> bool:
        """:meth:`charge` from a coroutine: awaits its batch without holding a thread."""
        if self.writer is not None:
            return await self.writer.acharge(charge)
        return await asyncio.to_thread(self.store.spend.charge, charge)

    def submit_charge(self, charge: ModelCharge,
                      loop: asyncio.AbstractEventLoop) -> asyncio.Future[bool]:
        """Queue :meth:`charge` now (from any thread); its outcome as a future on ``loop``.

        Through the writer: one queue put, the row group-committed with the others.
        Without one: written in a thread of its own pool.
        """
        if self.writer is not None:
            return self.writer.enqueue(charge, loop)
        return asyncio.wrap_future(self._charges.submit(self.store.spend.charge, charge), loop=loop)

    async def amark_failed(self, charge: ModelCharge, error: str) -> bool:
        """Give the recorded row of ``charge`` its error (fenced); False: lease gone."""
        return await asyncio.to_thread(self.store.spend.mark_call_failed, charge, error)

    def take_tokens(self, tenant: str, need: float, rate: float, refund: float) -> float:
        """A tenant's token bucket: 0 when ``need`` was taken, else the seconds to wait."""
        return self.store.spend.take_tenant_tokens(tenant, need, rate, refund)

    async def arecorded_calls(self, lookups: Sequence[RecordLookup]
                              ) -> list[RecordedCall | None]:
        """The task's recorded successful reply for each look-up, in order (one statement).

        With a ``counterpart`` (a fork's branch), the counterpart's reply when the task has
        none of its own. On the running loop's own connection: a re-run replays a call
        per task, and through the Store each batch cost a thread hop, a pool checkout and
        SQLAlchemy's statement handling.
        """
        rows = await self.step_writer.fetch_all(
            _RECORDED_MANY, {"batch": dumps_fast(_lookups(lookups))})
        found = {int(r.n): r._asdict() for r in rows}
        return [RecordedCall.from_row(found[n]) if n in found else None
                for n in range(len(lookups))]

    async def aadopt_replies(self, tasks: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> int:
        """Adopt the tasks' journaled replies never charged (in a thread: one transaction)."""
        return await asyncio.to_thread(self.replies.adopt, tasks)

    def gate_calls(self, task_ids: Sequence[uuid.UUID]
                   ) -> tuple[dict[uuid.UUID, tuple[str | None, bool, uuid.UUID | None]],
                              Callable[[], None]]:
        """For the model-call gate: each task's status, whether its tree is paused, its holder.

        Read under the trees' steering locks, held until the returned ``release()``.
        """
        rows, release = self.store.steering.gate_calls_held(task_ids)
        return {i: (g.status, g.paused, g.lease_token) for i, g in rows.items()}, release

    def step_begin(self, begin: StepBegin) -> StepRecord | None:
        """Record a durable step as started, or return its finished record (fenced)."""
        return self.store.steps.begin(begin)

    def step_from_counterpart(self, begin: StepBegin,
                              counterpart: uuid.UUID) -> StepRecord | None:
        """A fork's branch task's step served from its counterpart's record, or None."""
        return self.store.steps.from_counterpart(begin, counterpart)

    def step_finished_at(self, task_id: uuid.UUID, phase: str, position: str, name: str,
                         args_hash: str) -> bool:
        """Whether ``task_id`` finished that step with those arguments (a counterpart's)."""
        return self.store.steps.finished_at(task_id, phase, position, name, args_hash)

    def step_finish(self, end: StepEnd) -> bool:
        """Record a step's result or error (fenced); False when the lease is gone."""
        return self.store.steps.finish(end)

    async def astep_begin(self, begin: StepBegin) -> StepRecord | None:
        """:meth:`step_begin` from a coroutine, on the running loop's own connection."""
        return await self.step_writer.begin(begin)

    async def astep_finish(self, end: StepEnd) -> bool:
        """:meth:`step_finish` from a coroutine, on the running loop's own connection."""
        return await self.step_writer.finish(end)

    async def aclose(self) -> None:
        """Close the running loop's step connections (before the loop ends)."""
        await self.step_writer.aclose()

    def tool_approval(self, task_id: uuid.UUID, lease_token: uuid.UUID, phase: str,
                      call_id: str, tool: str, args_hash: str, args: str) -> str | None:
        """A tool call's decision, or ``asked`` now (fenced); None when the lease is gone."""
        return self.store.steps.tool_approval(task_id, lease_token, phase, call_id, tool,
                                              args_hash, args)


def _lookups(lookups: Sequence[RecordLookup]) -> list[dict[str, Any]]:
    """Look-ups as the batch parameter of ``model_call_get_recorded_many``."""
    return [{"n": n, "task_id": str(lk.task_id),
             "counterpart": None if lk.counterpart is None else str(lk.counterpart),
             "phase": lk.phase, "position": lk.position, "hashes": lk.hashes}
            for n, lk in enumerate(lookups)]
