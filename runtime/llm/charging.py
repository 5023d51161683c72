"""The charge stage: every request of a call is a ``model_calls`` row, charged to its task.

A request that was answered is recorded and charged the moment its reply arrives
(:meth:`Charger.arrived`, called through :mod:`runtime.llm.arrival`): its row is queued to
the ledger's group-committed writer before the reply is validated, repaired or handed on
(an answer is durable on arrival, SPEC section 15), and :meth:`Charger.answered` then
awaits that write. Its tokens are charged at the routed model's price
(:func:`runtime.budget.call_cost`), once. A reply that turns out bad (a structured reply
that does not fit) keeps its row and its charge, and the row gets its error
(:meth:`Charger.failed`: the ledger's ``amark_failed``). A request that failed with no
reply recorded is charged what it spent (a backend's bad reply), with its error; one
refused before it was sent (the lease lost, the budget) writes nothing. A replayed call
writes a zero-cost ``replayed`` row. Every write is fenced by the task's lease: a refused
write means the task was taken away, and the call's answer is dropped
(:class:`~runtime.errors.LeaseLost`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol

from runtime.budget import call_cost
from runtime.errors import BudgetExceeded, LeaseLost, TransientModelError
from runtime.llm.arrival import Recorded
from runtime.llm.call_records import Rows, arrived_row
from runtime.llm.reply import ModelReply
from runtime.llm.request import CallProgress
from runtime.records import ModelCharge

log = logging.getLogger(__name__)


class ChargeLedger(Protocol):
    """The ledger's charge writes (:class:`runtime.llm.ledger.CallLedger` has them)."""

    async def acharge(self, charge: ModelCharge) -> bool:
        """Record and charge one row; False when the task's lease is gone."""
        ...

    def submit_charge(self, charge: ModelCharge,
                      loop: asyncio.AbstractEventLoop) -> asyncio.Future[bool]:
        """Queue one row at once (from any thread); its outcome as a future on ``loop``."""
        ...

    async def amark_failed(self, charge: ModelCharge, error: str) -> bool:
        """Give a recorded row its error; False when the task's lease is gone."""
        ...


@dataclass
class Arrival:
    """A reply recorded on arrival: its row, what it charged, the write's outcome."""

    charge: ModelCharge
    written: asyncio.Future[bool]

    @property
    def tokens(self) -> int:
        """The tokens its row charges."""
        return self.charge.prompt_tokens + self.charge.completion_tokens

    @property
    def cost(self) -> Decimal:
        """The cost its row charges."""
        return self.charge.cost_usd

    @property
    def charged(self) -> tuple[int, Decimal]:
        """What the request counts as charged: nothing once the write was refused."""
        written = self.written
        # Refused (the lease was gone) or failed (the transaction did not commit); a
        # write not known yet counts as made (a budget never under-counts).
        refused = written.done() and not written.cancelled() and (
            written.exception() is not None or not written.result())
        return (0, Decimal(0)) if refused else (self.tokens, self.cost)


def error_name(exc: BaseException) -> str:
    """The error's class as recorded: a retryable error is recorded as transient."""
    return "TransientModelError" if isinstance(exc, TransientModelError) else type(exc).__name__


class Charger:
    """Writes and charges the rows of one task's requests.

    Args:
        write: the ledger's charge (awaited on the loop).
        rows: whose rows they are (task, lease, attempt, phase, backend).

    """

    def __init__(self, ledger: ChargeLedger, rows: Rows) -> None:
        self._ledger = ledger
        self.rows = rows

    def arrived(self, call: CallProgress, reply: ModelReply, loop: asyncio.AbstractEventLoop,
                recorded: Recorded | None = None) -> Arrival:
        """Queue the row of a reply that just arrived (before it is checked); no waiting.

        Safe from any thread (the reply loop's, or ``loop``'s own); the outcome of the
        write is a future on ``loop``, where :meth:`answered` or :meth:`failed` awaits
        it. The row is the request's own (``call_try``, ``attempt_kind``), with no error.
        ``recorded``: the row as the recorder process already queued it, and its write's
        outcome (:mod:`runtime.llm.recorder`): nothing is queued here then.
        """
        if recorded is None:
            charge = arrived_row(self.rows.template(call, call.kind), reply,
                                 call.routed.price, keep_text=self.rows.record)
            written = self._ledger.submit_charge(charge, loop)
        else:
            charge, outcome = recorded
            written = asyncio.wrap_future(outcome, loop=loop)
        arrival = Arrival(charge, written)
        call.arrival = arrival
        return arrival

    async def answered(self, call: CallProgress, reply: ModelReply) -> tuple[int, Decimal]:
        """Charge an answered request (recorded on arrival); return the tokens and cost.

        Raises:
            LeaseLost: the row was refused (the task was taken away): the answer is dropped.

        """
        arrival = call.arrival
        if arrival is None:  # nobody recorded it on arrival: record it now
            arrival = self.arrived(call, reply, asyncio.get_running_loop())
        if not await arrival.written:
            raise LeaseLost(f"task {self.rows.task_id}: lease lost; the model call was not "
                            "charged and its answer is dropped")
        call.cost += arrival.cost
        return arrival.tokens, arrival.cost

    async def replayed(self, call: CallProgress, reply: ModelReply) -> None:
        """Write the zero-cost ``replayed`` row of a call served from the record."""
        await self._fenced(self.rows.replayed(call, reply))

    async def failed(self, call: CallProgress, exc: Exception, reply: ModelReply | None,
                     duration: float) -> tuple[int, Decimal]:
        """Record a failed request (with the tokens it used, if any); return what was charged.

        A reply recorded on arrival keeps its row and its charge; its row gets the error.
        A lost lease found here wins over the call's own error: the worker must drop the
        task rather than retry or fail it.
        """
        if call.arrival is not None:
            return await self._arrived_bad(call, exc)
        # Refused before it was sent. (A cancelled call never comes here: CancelledError
        # is not an Exception, so the sender's ``except Exception`` lets it through.)
        if isinstance(exc, LeaseLost | BudgetExceeded):
            return 0, Decimal(0)
        prompt_tokens = reply.prompt_tokens if reply else 0
        completion_tokens = reply.completion_tokens if reply else 0
        cost = call_cost(prompt_tokens + completion_tokens, call.routed.price)
        charge = self.rows.row(call, call.kind, reply, prompt_tokens, completion_tokens,
                               duration, cost, f"{error_name(exc)}: {exc}")
        try:
            applied = await self._ledger.acharge(charge)
        except Exception:  # never hide the call's own error behind a recording error
            log.exception("could not record a failed model call",
                          extra={"task_id": str(self.rows.task_id)})
            return 0, Decimal(0)
        if not applied:
            raise self._lost_during(exc) from exc
        call.cost += cost
        return prompt_tokens + completion_tokens, cost

    async def _arrived_bad(self, call: CallProgress, exc: Exception) -> tuple[int, Decimal]:
        """A reply recorded on arrival turned out bad: its row gets the error; it stays paid.

        Only an error of the reply itself is written on its row (a lost lease or a
        cancel while the row was being written says nothing about the reply).
        """
        arrival = call.arrival
        assert arrival is not None
        try:
            written = await arrival.written
        except Exception:  # never hide the call's own error behind a recording error
            log.exception("could not record a model call's reply",
                          extra={"task_id": str(self.rows.task_id)})
            return 0, Decimal(0)
        if not written:
            raise self._lost_during(exc) from exc
        call.cost += arrival.cost
        if not isinstance(exc, LeaseLost | BudgetExceeded):
            marked = await self._ledger.amark_failed(arrival.charge, f"{error_name(exc)}: {exc}")
            if not marked:
                raise self._lost_during(exc) from exc
        return arrival.tokens, arrival.cost

    def _lost_during(self, exc: Exception) -> LeaseLost:
        """The error of a failed call whose row was refused: the task was taken away."""
        return LeaseLost(f"task {self.rows.task_id}: lease lost during a failed model call "
                         f"({exc})")

    async def _fenced(self, charge: ModelCharge) -> None:
        if not await self._ledger.acharge(charge):
            raise LeaseLost(f"task {self.rows.task_id}: lease lost; the model call was not "
                            "charged and its answer is dropped")

