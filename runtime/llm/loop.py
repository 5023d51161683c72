"""Where model calls run, and the per-server limits (slots) that go with the loop.

Async code awaits its calls on its own running loop: the async worker's agents make their
calls on the worker's one loop, beside its claims and writes, with no hand-over to another
thread. Synchronous code (a sync agent or the judge in a
worker thread, a script) submits with :meth:`CallLoop.run` to the loop *attached* by a
running worker (:meth:`CallLoop.attach`), or, when none is, to a loop the model layer
starts in a daemon thread, stopped by :meth:`CallLoop.close`. So in a worker every call
runs on one loop, and the fair slots of :meth:`CallLoop.slot` (one set per loop) bound
all the calls in flight per server of the process (``[ollama] max_parallel``; the cloud
route's server has ``cloud_max_parallel``).

A thread that waits in :meth:`CallLoop.run` is *parked*: it holds no slot and runs no
Python until the reply comes. A thread pool can count its parked threads (and start
others in their place) by installing :func:`set_park_hooks` in its threads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from runtime.config import SchedulerSettings, Settings
from runtime.llm.fair_slots import FairSlots
from runtime.llm.token_meter import TokenMeter

T = TypeVar("T")
log = logging.getLogger(__name__)

_parking = threading.local()


def set_park_hooks(park: Callable[[], None] | None, unpark: Callable[[], None] | None) -> None:
    """Call ``park()`` before, ``unpark()`` after, this thread waits on a model call.

    For the current thread only (a pool installs them in each of its threads); ``None``
    removes them.
    """
    _parking.hooks = (park, unpark) if park is not None and unpark is not None else None


def token_rates(settings: Settings) -> dict[str, int]:
    """``{tenant: tokens_per_minute}`` of the tenants that set one."""
    return {name: t.tokens_per_minute for name, t in settings.tenants.items()
            if t.tokens_per_minute is not None}


class CallLoop:
    """The loop sync callers' model calls run on: an attached one, or owned in a thread."""

    def __init__(self) -> None:
        self._attached: asyncio.AbstractEventLoop | None = None
        self._owned: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._slots: dict[tuple[int, str, int], FairSlots] = {}
        #: ``[scheduler]`` (max_wait_seconds, anticipate_seconds) of the slots made from
        #: now on; None: the defaults.
        self.scheduler: SchedulerSettings | None = None
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

    def slot(self, host: str, limit: int) -> FairSlots:
        """The fair slots bounding calls in flight to a route's server (running loop).

        A route is its server ``host`` and its limit (``[ollama] max_parallel`` or
        ``cloud_max_parallel``, per server): every model's calls on it share one set of
        ``limit`` slots, keyed as the backend keys its connection pool
        (``OllamaBackend.client_for``), so the calls the slots let through never wait
        for a connection. Two models on one server share its limit and its pool.
        """
        key = (id(asyncio.get_running_loop()), host, limit)
        slots = self._slots.get(key)
        if slots is None:
            s = self.scheduler or SchedulerSettings()
            slots = self._slots[key] = FairSlots(limit, s.max_wait_seconds, self.meter,
                                                 s.anticipate_seconds)
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
                try:
                    asyncio.run_coroutine_threadsafe(final, loop).result(timeout=10)
                except Exception:  # closing is best effort: the loop stops below anyway
                    log.warning("closing the model connections failed; stopping their loop",
                                exc_info=True)
            else:
                final.close()
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()
            with self._lock:
                self._owned, self._thread = None, None
