"""Blocking work in threads, its results back on the event loop, one wake-up per batch.

``loop.run_in_executor`` and ``asyncio.wrap_future`` hand every result back with its own
``loop.call_soon_threadsafe``, and each of those writes a byte to the loop's wake-up pipe:
a system call per result, plus the ``concurrent.futures`` machinery around it. With a
thousand results a second that is most of what a hand-off costs (about 90 us of CPU per
call against about 8 us with this module, measured on the two-core bench machine with 32
threads).

- :class:`LoopHandoff` settles asyncio futures from any thread: a thread appends the
  result to a queue and wakes the loop only when no wake-up is pending already; the loop
  then settles everything queued. :func:`handoff_for` gives the one handoff of a loop.
- :class:`ThreadRunner` is a set of threads that run blocking calls for coroutines
  (``await runner.run(fn, *args)``), their results handed back through the handoff.
  Fixed, or *elastic* (``max_threads`` above ``threads``): a thread that parks on a model
  call (:func:`runtime.llm.loop.set_park_hooks`) is replaced by a new one, so ``threads``
  threads are always free to run Python; a thread beyond that retires when its call
  ends. The pool grows with the calls in flight, up to ``max_threads``.

Failure modes: an exception raised by ``fn`` is raised by ``run``; a future cancelled
while its call runs is not settled (the call still runs to its end, as with
``run_in_executor``); a result for a loop that has closed is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from runtime.llm.loop import set_park_hooks

T = TypeVar("T")

_Settled = tuple["asyncio.Future[Any]", Any, BaseException | None]


class LoopHandoff:
    """Settles futures of one event loop from other threads (see the module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ready: collections.deque[_Settled] = collections.deque()
        self._lock = threading.Lock()
        self._wake_pending = False

    def settle(self, future: asyncio.Future[Any], result: Any = None,
               error: BaseException | None = None) -> None:
        """Give ``future`` its result (or ``error``) on its loop; safe from any thread."""
        self._ready.append((future, result, error))
        with self._lock:
            if self._wake_pending:
                return  # the loop has a wake-up coming and will take this one too
            self._wake_pending = True
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits it now
            self._loop.call_soon_threadsafe(self._settle_ready)

    def _settle_ready(self) -> None:
        with self._lock:
            self._wake_pending = False
        ready = self._ready
        while ready:
            future, result, error = ready.popleft()
            if future.done():  # cancelled while its call ran
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)


_handoffs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopHandoff] = \
    weakref.WeakKeyDictionary()
_handoffs_lock = threading.Lock()


def handoff_for(loop: asyncio.AbstractEventLoop) -> LoopHandoff:
    """The handoff of ``loop`` (one per loop, made on first use)."""
    handoff = _handoffs.get(loop)
    if handoff is None:
        with _handoffs_lock:
            handoff = _handoffs.get(loop)
            if handoff is None:
                handoff = _handoffs[loop] = LoopHandoff(loop)
    return handoff


_Job = tuple[LoopHandoff, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class ThreadRunner:
    """``threads`` threads, started at once, that run blocking calls for coroutines.

    Args:
        threads: how many calls run at once (not counting calls parked on a model call);
            more wait in a queue, first come first run.
        name: the threads' name prefix (``name_0``, ``name_1``, ...).
        max_threads: elastic when above ``threads``: the most threads, parked included.
        on_park: called (in the parking thread, after the pool's bookkeeping) when a
            thread parks, say to let its owner take more work.

    """

    def __init__(self, threads: int, name: str, max_threads: int | None = None,
                 on_park: Callable[[], None] | None = None) -> None:
        if threads < 1:
            raise ValueError("a ThreadRunner needs at least one thread")
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._name = name
        self._want = threads
        self._max = max(threads, max_threads or threads)
        self._on_park = on_park
        self._lock = threading.Lock()
        self._closed = False
        self._parked = 0
        self._spawned = 0
        self.peak_threads = threads
        self._threads: set[threading.Thread] = set()
        with self._lock:
            first = [self._spawn() for _ in range(threads)]
        for thread in first:
            thread.start()

    @property
    def parked(self) -> int:
        """Threads waiting on a model call right now."""
        return self._parked

    @property
    def size(self) -> int:
        """Threads alive (or starting) right now, parked included."""
        return len(self._threads)

    def _spawn(self) -> threading.Thread:
        """Count one more thread (lock held); the caller starts it, lock released."""
        thread = threading.Thread(target=self._serve, name=f"{self._name}_{self._spawned}",
                                  daemon=True)
        self._spawned += 1
        self._threads.add(thread)
        self.peak_threads = max(self.peak_threads, len(self._threads))
        return thread

    def _park(self) -> None:
        """A thread of this runner waits on a model call: start one in its place.

        The new thread is started outside the lock: ``Thread.start`` waits until the
        thread runs (it needs the GIL), and other threads parking meanwhile must not
        queue behind that wait.
        """
        spawned = None
        with self._lock:
            self._parked += 1
            if not self._closed and len(self._threads) - self._parked < self._want \
                    and len(self._threads) < self._max:
                spawned = self._spawn()
        if spawned is not None:
            spawned.start()
        if self._on_park is not None:
            self._on_park()

    def _unpark(self) -> None:
        with self._lock:
            self._parked -= 1

    def _retire(self) -> bool:
        """After a call: whether this thread is one too many (it then leaves the pool)."""
        if self._max == self._want or len(self._threads) - self._parked <= self._want:
            return False
        with self._lock:
            if len(self._threads) - self._parked <= self._want:
                return False
            self._threads.discard(threading.current_thread())
            return True

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in one of the threads; return (or raise) what it does."""
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """:meth:`run` without a coroutine: the future of ``fn(*args)``, on the running loop.

        Cancelling the future before a thread takes the call skips it.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((handoff_for(loop), future, fn, args))
        return future

    def shutdown(self, wait: bool = True, cancel_pending: bool = False) -> None:
        """Stop the threads once the queued calls have run (``cancel_pending``: drop them).

        ``wait``: return only when every thread has ended.
        """
        if cancel_pending:  # their coroutines are being cancelled with the loop
            with contextlib.suppress(queue.Empty):
                while True:
                    self._jobs.get_nowait()
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        if wait:
            for thread in threads:
                thread.join()

    def _serve(self) -> None:
        if self._max > self._want:
            set_park_hooks(self._park, self._unpark)
        while (job := self._jobs.get()) is not None:
            handoff, future, fn, args = job
            if future.done():  # cancelled before it started: do not run it
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # raised in the awaiting coroutine (run_in_executor's way)
                handoff.settle(future, error=exc)
            else:
                handoff.settle(future, result)
            if self._retire():
                return
        with self._lock:
            self._threads.discard(threading.current_thread())
