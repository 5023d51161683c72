"""The event loop model calls run on, and the per-server, per-model limits that live on it.

:class:`CallLoop` either borrows a running loop (the async worker's, given to
:class:`~runtime.llm.handle.LLMFactory` as ``loop=``) or starts one background thread
running its own loop, closed by :meth:`CallLoop.close`. Synchronous code submits
coroutines with :meth:`CallLoop.run` (``asyncio.run_coroutine_threadsafe(...).result()``);
async code on another loop awaits :meth:`CallLoop.submit`. The semaphores of
:meth:`CallLoop.slot` bound the calls in flight per (server, model).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class CallLoop:
    """An event loop for model calls (borrowed, or owned in a daemon thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        self._owned = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, str], asyncio.Semaphore] = {}

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make calls on ``loop`` from now on (before the first call).

        Raises:
            RuntimeError: calls already run on another loop.

        """
        with self._lock:
            if self._loop is not None and self._loop is not loop:
                raise RuntimeError("the model layer already runs its calls on another loop")
            self._loop = loop

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop calls run on; the first use starts the owned one when none was given."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="orgchart-llm-loop",
                                          daemon=True)
                thread.start()
                self._loop, self._thread, self._owned = loop, thread, True
            return self._loop

    def on_loop(self) -> bool:
        """Whether the caller is running on this loop (so it may await directly)."""
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop from a thread that is not the loop's; return its result.

        Raises:
            RuntimeError: called from the loop's own thread (it would wait for itself).

        """
        if self.on_loop():
            coro.close()
            raise RuntimeError("complete() was called on the model loop's own thread; "
                               "await acomplete() there instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def submit(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the loop from a coroutine running on any loop."""
        if self.on_loop():
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def slot(self, host: str, model: str, limit: int) -> asyncio.Semaphore:
        """The semaphore bounding calls in flight to ``model`` on ``host`` (on the loop)."""
        key = (host, model)
        sem = self._slots.get(key)
        if sem is None:
            sem = self._slots[key] = asyncio.Semaphore(limit)
        return sem

    def close(self, final: Coroutine[Any, Any, Any] | None = None) -> None:
        """Run ``final`` (closing connections) on the loop, then stop an owned loop."""
        loop = self._loop
        if final is not None:
            if loop is not None and loop.is_running() and not self.on_loop():
                with contextlib.suppress(Exception):  # closing is best effort
                    asyncio.run_coroutine_threadsafe(final, loop).result(timeout=10)
            else:
                final.close()
        if self._owned and loop is not None and self._thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=10)
            loop.close()
            with self._lock:
                self._loop, self._thread, self._owned = None, None, False
