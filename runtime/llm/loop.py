"""Where model calls run, and the per-server, per-model limits that go with the loop.

Async code awaits its calls on its own running loop: the async worker's agents make their
calls on the worker's one loop, beside its claims and writes, with no hand-over to another
thread. Synchronous code (a sync agent or the judge in a
worker thread, a script) submits with :meth:`CallLoop.run` to the loop *attached* by a
running worker (:meth:`CallLoop.attach`), or, when none is, to a loop the model layer
starts in a daemon thread, stopped by :meth:`CallLoop.close`. So in a worker every call
runs on one loop, and the semaphores of :meth:`CallLoop.slot` (one set per loop) bound
all the calls in flight per (server, route) of the process.

A thread that waits in :meth:`CallLoop.run` is *parked*: it holds no slot and runs no
Python until the reply comes. A thread pool can count its parked threads (and start
others in their place) by installing :func:`set_park_hooks` in its threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

from runtime.config import Settings
from runtime.errors import LeaseLost

T = TypeVar("T")
log = logging.getLogger(__name__)

_parking = threading.local()


def set_park_hooks(park: Callable[[], None] | None, unpark: Callable[[], None] | None) -> None:
    """Call ``park()`` before, ``unpark()`` after, this thread waits on a model call.

    For the current thread only (a pool installs them in each of its threads); ``None``
    removes them.
    """
    _parking.hooks = (park, unpark) if park is not None and unpark is not None else None


#: A waiting call older than this is served first, whatever its share (nothing starves).
DEFAULT_MAX_WAIT_SECONDS = 300.0
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
    """

    def __init__(self, rates: Mapping[str, int], take: TakeTokens | None,
                 off_loop: Callable[..., Awaitable[Any]]) -> None:
        self.rates = dict(rates) if take is not None else {}
        self._take = take
        self._off_loop = off_loop
        self._refunds: dict[str, float] = {}
        self._queues: dict[tuple[int, str], list[asyncio.Future[None]]] = {}
        self._flushing: dict[str, asyncio.Task[None]] = {}

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
        try:
            while not turn.done():
                _check(stopped)
                await asyncio.wait([turn], timeout=BUCKET_POLL_SECONDS)
            return await self._take_when_there(tenant, estimate, stopped)
        finally:
            queue.remove(turn)
            if queue and not queue[0].done():
                queue[0].set_result(None)

    async def _take_when_there(self, tenant: str, estimate: float, stopped: StopCheck) -> float:
        rate = float(self.rates[tenant])
        need = min(max(float(estimate), 0.0), rate)
        assert self._take is not None
        while True:
            _check(stopped)
            refund = self._refunds.pop(tenant, 0.0)  # lost if the take fails: stricter
            wait = await self._off_loop(self._take, tenant, need, rate, refund)
            if wait <= 0:
                return need
            await asyncio.sleep(min(wait, BUCKET_POLL_SECONDS))

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


def token_rates(settings: Settings) -> dict[str, int]:
    """``{tenant: tokens_per_minute}`` of the tenants that set one."""
    return {name: t.tokens_per_minute for name, t in settings.tenants.items()
            if t.tokens_per_minute is not None}


def stop_check(task_id: Any, lease_lost: threading.Event,
               is_stopped: Callable[[Any], bool]) -> StopCheck:
    """The :data:`StopCheck` of one task's calls: its lease lost, or the gate stopped it."""

    def stopped() -> str | None:
        if lease_lost.is_set() or is_stopped(task_id):
            return f"task {task_id}: stopped while its call waited for its tenant's tokens"
        return None

    return stopped


def _check(stopped: StopCheck) -> None:
    reason = stopped()
    if reason is not None:
        raise LeaseLost(reason)


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
    """

    def __init__(self, limit: int, max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS,
                 meter: TokenMeter | None = None) -> None:
        self.limit = limit
        self.meter = meter
        self.free = limit
        self.max_wait_seconds = max_wait_seconds
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
        queue = self._queues[tenant][waiter.tree]
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
        """Hand the slot just freed to the next waiting call."""
        tenant, waiter = self._next()
        heapq.heappop(self._queues[tenant][waiter.tree])
        self._dequeued(tenant, waiter.tree)
        # Charged now, not when the waiter resumes: several slots freed at once (calls
        # that started together end together) go one by one in fair order, not all to
        # the flow that was ahead before the first of them.
        t = waiter.ticket
        self._charge(t.tenant, t.tree, t.estimate, t.weight)
        waiter.future.set_result(None)

    def release(self) -> None:
        """A call ended: its slot goes to the next waiting call, or back to the free ones."""
        if self.waiting > 0:
            self._grant()
        else:
            self.free += 1


class Ticket:
    """One call's turn at a :class:`FairSlots` (re-enterable: a paused call waits again).

    For a tenant with a token bucket, the first entry takes the call's tokens; they are
    held until :meth:`settle` (what the call spent) or an exit by an exception (nothing).
    """

    def __init__(self, slots: FairSlots, tenant: str, tree: Any, priority: int,
                 weight: float, estimate: float, stopped: StopCheck | None = None) -> None:
        self.slots, self.tenant, self.tree = slots, tenant, tree
        self.priority, self.weight, self.estimate = priority, weight, max(estimate, 0.0)
        self.stopped: StopCheck = stopped or (lambda: None)
        self.held: float | None = None  # tokens taken from the tenant's bucket

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
        self.slots.release()
        if exc is not None:
            self._give_back(0.0)  # nothing answered: nothing spent

    def settle(self, cost: float) -> None:
        """Replace the estimate charged at the start with what the call spent."""
        self.slots._charge(self.tenant, self.tree, cost - self.estimate, self.weight)
        self.estimate = cost
        self._give_back(cost)

    def _give_back(self, spent: float) -> None:
        held, self.held = self.held, None
        if held is not None and self.slots.meter is not None:
            self.slots.meter.settle(self.tenant, held, spent)


class CallLoop:
    """The loop sync callers' model calls run on: an attached one, or owned in a thread."""

    def __init__(self) -> None:
        self._attached: asyncio.AbstractEventLoop | None = None
        self._owned: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._slots: dict[tuple[int, str, int], FairSlots] = {}
        #: ``[scheduler] max_wait_seconds`` for the slots made from now on.
        self.max_wait_seconds = DEFAULT_MAX_WAIT_SECONDS
        #: The tenants' token buckets, for the slots made from now on.
        self.meter: TokenMeter | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run sync callers' calls on ``loop`` (a running worker's) until :meth:`detach`."""
        with self._lock:
            self._attached = loop

    def detach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop using ``loop`` (it is about to close); forget its semaphores."""
        with self._lock:
            if self._attached is loop:
                self._attached = None
            for key in [k for k in self._slots if k[0] == id(loop)]:
                del self._slots[key]

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop sync callers' calls run on; starts the owned one when none is attached."""
        with self._lock:
            if self._attached is not None:
                return self._attached
            if self._owned is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="orgchart-llm-loop",
                                          daemon=True)
                thread.start()
                self._owned, self._thread = loop, thread
            return self._owned

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on :attr:`loop` from a thread that is not the loop's; return its result.

        Raises:
            RuntimeError: called from the loop's own thread (it would wait for itself).

        """
        target = self.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is target:
            coro.close()
            raise RuntimeError("complete() was called on the model loop's own thread; "
                               "await acomplete() there instead")
        future = asyncio.run_coroutine_threadsafe(coro, target)
        hooks = getattr(_parking, "hooks", None)
        if hooks is None:
            return future.result()
        park, unpark = hooks
        park()  # this thread waits for the loop now: its pool may start another
        try:
            return future.result()
        finally:
            unpark()

    def slot(self, host: str, model: str, limit: int) -> FairSlots:
        """The fair slots bounding calls in flight to a route's server (running loop).

        A route is its server ``host`` and its limit (``[ollama] max_parallel`` or
        ``cloud_max_parallel``): every model's calls on it share one semaphore of ``limit``
        slots, keyed as the backend keys its connection pool
        (``OllamaBackend._client_for``), so the calls the slots let through never wait
        for a connection. ``model`` is not part of the key (two models on one server
        share its limit and its pool).
        """
        del model  # one limit per server and route, whatever the model
        key = (id(asyncio.get_running_loop()), host, limit)
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = FairSlots(limit, self.max_wait_seconds, self.meter)
        return slots

    def pressure(self, loop: asyncio.AbstractEventLoop) -> tuple[int, int]:
        """``(slots, waiting)``: calls that may run at once on ``loop``, and calls waiting."""
        sets = [s for k, s in list(self._slots.items()) if k[0] == id(loop)]
        return sum(s.limit for s in sets), sum(s.waiting for s in sets)

    def close(self, final: Coroutine[Any, Any, Any] | None = None) -> None:
        """Run ``final`` (closing connections) on the owned loop, then stop it."""
        loop, thread = self._owned, self._thread
        if final is not None:
            if loop is not None and loop.is_running():
                with contextlib.suppress(Exception):  # closing is best effort
                    asyncio.run_coroutine_threadsafe(final, loop).result(timeout=10)
            else:
                final.close()
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()
            with self._lock:
                self._owned, self._thread = None, None
