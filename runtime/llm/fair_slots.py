"""A model server's call slots, handed out in weighted fair order.

:class:`FairSlots` bounds the calls in flight to a server (``[ollama] max_parallel``) and
serves the waiting ones by weighted fair queueing on cost, between tenants and between
trees (docs/operations.md, "Tenants"). It *anticipates*: a call that ends and whose flow
would be served next if it were waiting keeps its slot for that flow a moment
(``[scheduler] anticipate_seconds``), because a tree's next call (a parent's aggregate
after its children's calls, the next round of a tool loop) comes right after its last
one. Without it the slot goes to a wide tree's waiting call, and the small tree's next
call waits for a whole call of the wide tree to end. A tenant with a token bucket
(:class:`~runtime.llm.token_meter.TokenMeter`) takes a call's tokens before its slot.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

from runtime.config import SchedulerSettings
from runtime.llm.token_meter import StopCheck, TokenMeter

T = TypeVar("T")
log = logging.getLogger(__name__)

#: ``[scheduler]``'s defaults: ``max_wait_seconds`` (a call waiting longer is served first,
#: whatever its share) and ``anticipate_seconds`` (how long a slot is kept; 0: never).
_DEFAULTS = SchedulerSettings()


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    tree: Any = field(compare=False)
    enqueued: float = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)
    ticket: Ticket = field(compare=False)


@dataclass
class _Flow:
    """A tenant or a tree: its virtual time (cost served / weight)."""

    vtime: float = 0.0
    waiting: int = 0


class FairSlots:
    """``limit`` call slots to one server, handed out in weighted fair order, not FIFO.

    Free slots are taken at once. When all are busy, waiting calls are served by weighted
    fair queueing on cost (tokens): the tenant with the least cost served per unit of
    weight first; within it, the most urgent priority, then the tree with the least cost
    served; within a tree, first come first served. The cost charged when a call is handed
    its slot is the caller's estimate; :meth:`Ticket.settle` replaces it with what the call
    spent. A flow that was idle starts at most one round of slots (``limit`` calls of its
    estimate) behind the smallest virtual time of the backlogged ones: no more credit is
    banked while idle. A call waiting longer than ``max_wait_seconds`` is served first.

    Anticipation: when a call that was answered ends while others wait, and a call of its
    tree arriving now would be served before all of them (its tenant and its tree are
    behind their shares, and none of its calls wait), the slot is *held* for that tree for
    up to ``anticipate_seconds``: the tree's next call takes it on arrival; otherwise it
    goes to the waiting calls when the time is up. A hold costs the others at most that
    long per call of a flow that is behind; flows that keep calls waiting never hold, and
    no slot is held while a call is overdue.
    ``held`` counts the holds made, ``held_taken`` those a call took.
    """

    def __init__(self, limit: int, max_wait_seconds: float = _DEFAULTS.max_wait_seconds,
                 meter: TokenMeter | None = None,
                 anticipate_seconds: float = _DEFAULTS.anticipate_seconds) -> None:
        self.limit = limit
        self.meter = meter
        self.free = limit
        self.max_wait_seconds = max_wait_seconds
        self.anticipate_seconds = anticipate_seconds
        #: per (tenant, tree): the timers of the slots held for it
        self._holds: dict[tuple[str, Any], list[asyncio.TimerHandle]] = {}
        self.held = 0
        self.held_taken = 0
        self._seq = itertools.count()
        self._tenants: dict[str, _Flow] = {}
        self._trees: dict[Any, _Flow] = {}
        #: per tenant, per tree: the waiting calls (a heap by priority, then arrival)
        self._queues: dict[str, dict[Any, list[_Waiter]]] = {}
        self.waiting = 0

    def ticket(self, tenant: str, tree: Any, priority: int = 5, weight: float = 1.0,
               estimate: float = 1.0, stopped: StopCheck | None = None) -> Ticket:
        """A call's claim on a slot: ``async with`` it around the request.

        A tenant with a token bucket (:class:`TokenMeter`) takes ``estimate`` tokens from
        it first; ``stopped`` ends that wait.
        """
        return Ticket(self, tenant, tree, priority, weight, estimate, stopped)

    # ---------------------------------------------------------------- internals
    def _flow(self, flows: dict[Any, _Flow], key: Any, peers: list[_Flow],
              credit: float) -> _Flow:
        flow = flows.get(key)
        if flow is None:
            flow = flows[key] = _Flow()
        if flow.waiting == 0:  # coming back from idle: at most ``credit`` for the idle time
            busy = [p.vtime for p in peers if p.waiting > 0 and p is not flow]
            if busy:
                flow.vtime = max(flow.vtime, min(busy) - credit)
        return flow

    def _charge(self, tenant: str, tree: Any, cost: float, weight: float) -> None:
        self._tenants.setdefault(tenant, _Flow()).vtime += cost / weight
        self._trees.setdefault(tree, _Flow()).vtime += cost

    async def _acquire(self, t: Ticket) -> None:
        if self._take_hold(t):
            return
        if self.free > 0 and self.waiting == 0:
            self.free -= 1
            self._charge(t.tenant, t.tree, t.estimate, t.weight)
            return
        # A flow back from idle may go one round of slots ahead of the busy ones (a small
        # tree's few calls start at the next releases, not one in two), no more.
        credit = self.limit * t.estimate
        tenant = self._flow(self._tenants, t.tenant, list(self._tenants.values()),
                            credit / t.weight)
        trees = self._queues.setdefault(t.tenant, {})
        tree = self._flow(self._trees, t.tree,
                          [self._trees[k] for k in trees if k in self._trees], credit)
        waiter = _Waiter(t.priority, next(self._seq), t.tree, time.monotonic(),
                         asyncio.get_running_loop().create_future(), t)
        heapq.heappush(trees.setdefault(t.tree, []), waiter)
        tenant.waiting += 1
        tree.waiting += 1
        self.waiting += 1
        if self.free > 0:
            self.free -= 1
            self._grant()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release()  # granted as it was cancelled: hand the slot on
            else:
                self._forget(t.tenant, waiter)
            raise

    def _forget(self, tenant: str, waiter: _Waiter) -> None:
        queue = self._queues.get(tenant, {}).get(waiter.tree)
        if queue is None or waiter not in queue:
            return  # passed over by a grant already (see _grant)
        queue.remove(waiter)
        heapq.heapify(queue)
        self._dequeued(tenant, waiter.tree)

    def _dequeued(self, tenant: str, tree: Any) -> None:
        self._tenants[tenant].waiting -= 1
        self._trees[tree].waiting -= 1
        self.waiting -= 1
        if not self._queues[tenant][tree]:
            del self._queues[tenant][tree]
            if not self._queues[tenant]:
                del self._queues[tenant]

    def _next(self) -> tuple[str, _Waiter]:
        """The waiting call served next (fair order; the overdue first)."""
        now = time.monotonic()
        overdue = [(q[0].enqueued, tenant, q[0]) for tenant, trees in self._queues.items()
                   for q in trees.values() if now - q[0].enqueued > self.max_wait_seconds]
        if overdue:
            _, tenant, waiter = min(overdue, key=lambda o: o[0])
            return tenant, waiter
        tenant = min(self._queues, key=lambda k: self._tenants[k].vtime)
        trees = self._queues[tenant]
        tree = min(trees, key=lambda k: (trees[k][0].priority, self._trees[k].vtime))
        return tenant, trees[tree][0]

    def _grant(self) -> None:
        """Hand the slot just freed to the next waiting call (or to the free ones)."""
        while self.waiting > 0:
            tenant, waiter = self._next()
            heapq.heappop(self._queues[tenant][waiter.tree])
            self._dequeued(tenant, waiter.tree)
            if waiter.future.done():
                continue  # cancelled, its task not resumed yet: it would never use the slot
            # Charged now, not when the waiter resumes: several slots freed at once (calls
            # that started together end together) go one by one in fair order, not all to
            # the flow that was ahead before the first of them.
            t = waiter.ticket
            self._charge(t.tenant, t.tree, t.estimate, t.weight)
            waiter.future.set_result(None)
            return
        self.free += 1

    def release(self, answered: Ticket | None = None) -> None:
        """A call ended: its slot goes to the next waiting call, or back to the free ones.

        ``answered``: the ticket of a call that was answered; its slot may be held for
        its tree's next call (anticipation, see the class).
        """
        if self.waiting == 0:
            self.free += 1
        elif answered is not None and self._behind(answered):
            key = (answered.tenant, answered.tree)
            timers = self._holds.setdefault(key, [])
            timers.append(asyncio.get_running_loop().call_later(
                self.anticipate_seconds, self._hold_expired, key))
            self.held += 1
        else:
            self._grant()

    # ---------------------------------------------------------------- anticipation
    def _behind(self, t: Ticket) -> bool:
        """Whether a call of ``t``'s tree arriving now would be served before every waiting one."""
        if self.anticipate_seconds <= 0:
            return False
        trees = self._queues.get(t.tenant, {})
        if t.tree in trees:
            return False  # its own calls wait: the fair order gives them the slot anyway
        vtime = self._tenants[t.tenant].vtime
        if any(self._tenants[k].vtime <= vtime for k in self._queues if k != t.tenant):
            return False
        oldest = min(q[0].enqueued for queues in self._queues.values() for q in queues.values())
        if time.monotonic() - oldest > self.max_wait_seconds:
            return False  # an overdue call is served first, whatever the shares
        mine = (t.priority, self._trees[t.tree].vtime)
        return all(mine < (q[0].priority, self._trees[k].vtime) for k, q in trees.items())

    def _take_hold(self, t: Ticket) -> bool:
        """Take a slot held for ``t``'s tree, if one is."""
        timers = self._holds.get((t.tenant, t.tree))
        if not timers:
            return False
        timers.pop(0).cancel()
        if not timers:
            del self._holds[(t.tenant, t.tree)]
        self.held_taken += 1
        self._charge(t.tenant, t.tree, t.estimate, t.weight)
        return True

    def _hold_expired(self, key: tuple[str, Any]) -> None:
        """The tree's next call did not come in time: the held slot goes to the others."""
        timers = self._holds[key]
        timers.pop(0)
        if not timers:
            del self._holds[key]
        self.release()


class Ticket:
    """One call's turn at a :class:`FairSlots` (re-enterable: a paused call waits again).

    For a tenant with a token bucket, the first entry takes the call's tokens; they are
    held until :meth:`settle` (what the call spent) or an exit by an exception (nothing).
    A request awaited through :meth:`answer` that returns lets the slot anticipate the
    tree's next call at the exit (:class:`FairSlots`); an exit without an answer (the
    gate found the tree paused, an error) hands the slot on at once.
    """

    def __init__(self, slots: FairSlots, tenant: str, tree: Any, priority: int,
                 weight: float, estimate: float, stopped: StopCheck | None = None) -> None:
        self.slots, self.tenant, self.tree = slots, tenant, tree
        self.priority, self.weight, self.estimate = priority, weight, max(estimate, 0.0)
        self.stopped: StopCheck = stopped or (lambda: None)
        self.held: float | None = None  # tokens taken from the tenant's bucket
        self.answered = False

    async def __aenter__(self) -> Ticket:
        meter = self.slots.meter
        if meter is not None and self.held is None and meter.limits(self.tenant):
            self.held = await meter.reserve(self.tenant, self.estimate, self.stopped)
        try:
            await self.slots._acquire(self)
        except BaseException:
            self._give_back(0.0)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        answered, self.answered = self.answered and exc is None, False
        self.slots.release(self if answered else None)
        if exc is not None:
            self._give_back(0.0)  # nothing answered: nothing spent

    async def answer(self, request: Awaitable[T]) -> T:
        """Await ``request`` (sent under this ticket's slot); note that it was answered."""
        result = await request
        self.answered = True
        return result

    def settle(self, cost: float) -> None:
        """Replace the estimate charged at the start with what the call spent."""
        self.slots._charge(self.tenant, self.tree, cost - self.estimate, self.weight)
        self.estimate = cost
        self._give_back(cost)

    def _give_back(self, spent: float) -> None:
        held, self.held = self.held, None
        if held is not None and self.slots.meter is not None:
            self.slots.meter.settle(self.tenant, held, spent)

