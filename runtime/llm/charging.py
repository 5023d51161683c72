"""The charge stage: every request of a call is a ``model_calls`` row, charged to its task.

A request that was answered is charged its tokens at the routed model's price
(:func:`runtime.budget.call_cost`); one that failed after spending tokens (a bad
structured reply) is charged what it spent, with its error; one refused before it was
sent (the lease lost, the budget) writes nothing. A replayed call writes a zero-cost
``replayed`` row. Every write is fenced by the task's lease: a refused write means the
task was taken away, and the call's answer is dropped (:class:`~runtime.errors.LeaseLost`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from decimal import Decimal

from runtime.budget import call_cost
from runtime.errors import BudgetExceeded, LeaseLost, TransientModelError
from runtime.llm.call_records import Rows
from runtime.llm.reply import ModelReply
from runtime.llm.request import Request
from runtime.records import ModelCharge

log = logging.getLogger(__name__)

#: Writes one charge through the ledger; False when the task's lease is gone.
ChargeWrite = Callable[[ModelCharge], Awaitable[bool]]


def error_name(exc: BaseException) -> str:
    """The error's class as recorded: a retryable error is recorded as transient."""
    return "TransientModelError" if isinstance(exc, TransientModelError) else type(exc).__name__


class Charger:
    """Writes and charges the rows of one task's requests.

    Args:
        write: the ledger's charge (awaited on the loop).
        rows: whose rows they are (task, lease, attempt, phase, backend).

    """

    def __init__(self, write: ChargeWrite, rows: Rows) -> None:
        self._write = write
        self.rows = rows

    async def answered(self, request: Request, reply: ModelReply) -> tuple[int, Decimal]:
        """Charge an answered request; return the tokens and cost charged."""
        tokens = reply.prompt_tokens + reply.completion_tokens
        cost = call_cost(tokens, request.price)
        await self._fenced(self.rows.row(request, request.kind, reply, reply.prompt_tokens,
                                         reply.completion_tokens, reply.duration_seconds,
                                         cost, None))
        request.cost += cost
        return tokens, cost

    async def replayed(self, request: Request, reply: ModelReply) -> None:
        """Write the zero-cost ``replayed`` row of a call served from the record."""
        await self._fenced(self.rows.replayed(request, reply))

    async def failed(self, request: Request, exc: Exception, reply: ModelReply | None,
                     duration: float) -> tuple[int, Decimal]:
        """Record a failed request (with the tokens it used, if any); return what was charged.

        A lost lease found here wins over the call's own error: the worker must drop the
        task rather than retry or fail it.
        """
        # Refused before it was sent. (A cancelled call never comes here: CancelledError
        # is not an Exception, so the sender's ``except Exception`` lets it through.)
        if isinstance(exc, LeaseLost | BudgetExceeded):
            return 0, Decimal(0)
        prompt_tokens = reply.prompt_tokens if reply else 0
        completion_tokens = reply.completion_tokens if reply else 0
        cost = call_cost(prompt_tokens + completion_tokens, request.price)
        charge = self.rows.row(request, request.kind, reply, prompt_tokens, completion_tokens,
                               duration, cost, f"{error_name(exc)}: {exc}")
        try:
            applied = await self._write(charge)
        except Exception:  # never hide the call's own error behind a recording error
            log.exception("could not record a failed model call",
                          extra={"task_id": str(self.rows.task_id)})
            return 0, Decimal(0)
        if not applied:
            raise LeaseLost(f"task {self.rows.task_id}: lease lost during a failed model call "
                            f"({exc})") from exc
        request.cost += cost
        return prompt_tokens + completion_tokens, cost

    async def _fenced(self, charge: ModelCharge) -> None:
        if not await self._write(charge):
            raise LeaseLost(f"task {self.rows.task_id}: lease lost; the model call was not "
                            "charged and its answer is dropped")

