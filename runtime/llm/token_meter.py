"""The tenants' token buckets: a limited tenant's calls wait for their tokens.

A tenant with ``[tenants.<name>] tokens_per_minute`` takes each call's tokens from its
bucket before the call waits for its server slot (:mod:`runtime.llm.fair_slots`). The
buckets live in the database (``tenant_buckets``), so every worker and host takes from
the same one; tenants without a limit never reach the database.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from runtime.errors import LeaseLost

log = logging.getLogger(__name__)

#: The longest a call waiting for its tenant's tokens sleeps between two looks (at its
#: task: stopped? lease lost? and at the bucket: other workers' refunds come in).
BUCKET_POLL_SECONDS = 1.0
#: Takes from a tenant's bucket (``tenant, need, rate, refund``): 0 when taken, else the
#: seconds to wait (blocking: the ledger's ``take_tokens``, run off the loop).
TakeTokens = Callable[[str, float, float, float], float]
#: Says why a call may no longer start (its task stopped, its lease lost), or None.
StopCheck = Callable[[], "str | None"]


class TokenMeter:
    """Token buckets of the tenants with ``[tenants.<name>] tokens_per_minute``.

    The buckets live in the database (``tenant_buckets``: every worker and host takes from
    the same one). Before a call of a limited tenant waits for its server slot,
    :meth:`reserve` takes the call's estimate (its prompt plus its completion cap; at most
    one minute's worth, so a bigger call waits for a full bucket) in one statement, or
    sleeps (on the loop, holding no thread and no slot) until the refill covers it, looking
    at its task between sleeps: a stopped task or a lost lease ends the wait with
    :class:`~runtime.errors.LeaseLost`, a cancellation at once. One call per tenant and
    loop takes at a time, the others queue behind it in order (one statement per call,
    not one per waiting call per look). :meth:`settle` books what a call reserved and did
    not spend (negative: spent beyond) as a refund; refunds are sent with the next take,
    or by one flush in flight per tenant. A refund lost with its worker only makes the
    bucket stricter. Tenants without a limit never reach the database.

    :meth:`waiting_tasks` names the tasks whose calls wait here now (a
    :class:`~runtime.llm.gate.TaskStop` says whose a call is): a stopping worker lets them
    go at once instead of holding them for its grace, since a wait for a dry bucket can
    outlast it.
    """

    def __init__(self, rates: Mapping[str, int], take: TakeTokens | None,
                 off_loop: Callable[..., Awaitable[Any]]) -> None:
        self.rates = dict(rates) if take is not None else {}
        self._take = take
        self._off_loop = off_loop
        self._refunds: dict[str, float] = {}
        self._queues: dict[tuple[int, str], list[asyncio.Future[None]]] = {}
        self._flushing: dict[str, asyncio.Task[None]] = {}
        self._waiting: Counter[Any] = Counter()  # tasks whose calls have had to wait

    def limits(self, tenant: str) -> bool:
        """Whether ``tenant``'s calls take from a bucket."""
        return tenant in self.rates

    async def reserve(self, tenant: str, estimate: float, stopped: StopCheck) -> float:
        """Take a call's tokens from ``tenant``'s bucket, waiting for them; returns what was held.

        Raises:
            LeaseLost: ``stopped`` said so while the call waited.

        """
        queue = self._queues.setdefault((id(asyncio.get_running_loop()), tenant), [])
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(turn)
        if queue[0] is turn:
            turn.set_result(None)
        task = getattr(stopped, "task_id", None)
        waits = False
        try:
            while not turn.done():
                _check(stopped)
                if not waits:
                    self._waiting[task] += 1
                    waits = True
                await asyncio.wait([turn], timeout=BUCKET_POLL_SECONDS)
            rate = float(self.rates[tenant])
            need = min(max(float(estimate), 0.0), rate)
            assert self._take is not None
            while True:
                _check(stopped)
                refund = self._refunds.pop(tenant, 0.0)  # lost if the take fails: stricter
                wait = await self._off_loop(self._take, tenant, need, rate, refund)
                if wait <= 0:
                    return need
                if not waits:
                    self._waiting[task] += 1
                    waits = True
                await asyncio.sleep(min(wait, BUCKET_POLL_SECONDS))
        finally:
            if waits:
                self._waiting -= Counter([task])  # drops it at zero
            queue.remove(turn)
            if queue and not queue[0].done():
                queue[0].set_result(None)

    def waiting_tasks(self) -> set[Any]:
        """The tasks (``TaskStop.task_id``) whose calls wait for tokens now.

        A call counts once it has had to wait (behind another call of its tenant, or for
        the refill), until it has its tokens or gives up.
        """
        return {task for task in list(self._waiting) if task is not None}

    def settle(self, tenant: str, held: float, spent: float) -> None:
        """A call that held ``held`` tokens spent ``spent``: book the difference, send it soon."""
        if tenant not in self.rates or held == spent:
            return
        self._refunds[tenant] = self._refunds.get(tenant, 0.0) + held - spent
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # sent with the next take
        if tenant not in self._flushing:
            self._flushing[tenant] = loop.create_task(self._flush(tenant))

    async def _flush(self, tenant: str) -> None:
        """Send ``tenant``'s refunds (one statement for all that came meanwhile)."""
        assert self._take is not None
        try:
            while self._refunds.get(tenant):
                refund = self._refunds.pop(tenant)
                await self._off_loop(self._take, tenant, 0.0, float(self.rates[tenant]),
                                     refund)
        except Exception:  # a lost refund only makes the bucket stricter
            log.warning("could not send a tenant's token refund", exc_info=True)
        finally:
            self._flushing.pop(tenant, None)


def _check(stopped: StopCheck) -> None:
    reason = stopped()
    if reason is not None:
        raise LeaseLost(reason)
