"""The reply loop: model replies are read off their sockets on a thread of their own.

A worker's one event loop runs its agents, its claims and writes, and the steps of every
model call. When a thousand answers arrive within a fifth of a second, each waits for
its turn on that loop behind the handling of the answers before it: the reply sat in its
socket for tens to hundreds of milliseconds before anyone read it, and a SIGKILL in that
window lost answers the server had already sent (issue 44). So the requests of a backend
that talks to a server (``remote``: Ollama) run on this process's *reply loop*, an event
loop in a daemon thread that does nothing else: it sends the request, reads the reply as
soon as its bytes arrive, parses it and queues its row to the charge writer
(:mod:`runtime.llm.arrival`: a queue put, no wait), then hands the reply back to the
caller's loop. The caller's stages (slots, the start gate, validation, repair, the
budget) stay on the caller's loop.

:meth:`ReplyLoop.run` awaits a request made on the reply loop from the caller's loop:

- the caller's context goes with it (``contextvars``: the arrival hook, the request's
  retry-after box); the start gate's "sent" hook (:data:`runtime.llm.gate.REQUEST_SENT`)
  is called back on the caller's loop, never on this thread;
- cancelling the caller (the gate stops a cancelled task's calls) cancels the request on
  the reply loop, which drops its connection; a reply that arrived first is recorded
  all the same (the send stage counts it as charged);
- the request's result or error is the caller's.

One reply loop per process, started on first use; its thread is a daemon (it holds only
connections to model servers, closed by the backend's ``aclose``: :meth:`ReplyLoop.call`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from runtime.llm.gate import REQUEST_SENT

T = TypeVar("T")


class ReplyLoop:
    """An event loop in a daemon thread that makes remote requests and reads their replies."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        """The reply loop (started in its thread on first use)."""
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                started = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(started.set)
                    loop.run_forever()

                threading.Thread(target=serve, name="llm-replies", daemon=True).start()
                started.wait()
                self._loop = loop
            return self._loop

    async def run(self, make: Callable[[], Awaitable[T]]) -> T:
        """Await ``make()`` run on the reply loop, from the caller's loop (see the module doc)."""
        caller = asyncio.get_running_loop()
        replies = self.loop()
        if replies is caller:  # already on it (a backend's own helper): nothing to hop
            return await make()
        sent = REQUEST_SENT.get()
        said = None if sent is None else _on_loop(caller, sent)
        request = asyncio.run_coroutine_threadsafe(_made(make, said), replies)
        return await asyncio.wrap_future(request, loop=caller)

    async def call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """:meth:`run` without the gate's hook: closing a backend's connections, say."""
        replies = self.loop()
        if replies is asyncio.get_running_loop():
            return await make()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make(), replies))


async def _made(make: Callable[[], Awaitable[T]], sent: Callable[[], None] | None) -> T:
    """``make()`` on the reply loop, the gate's "sent" hook replaced by ``sent``."""
    token = REQUEST_SENT.set(sent)
    try:
        return await make()
    finally:
        REQUEST_SENT.reset(token)


def _on_loop(loop: asyncio.AbstractEventLoop, hook: Callable[[], None]) -> Callable[[], None]:
    """``hook`` called on ``loop`` from any thread (once the loop gets to it)."""
    def call() -> None:
        with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits for it now
            loop.call_soon_threadsafe(hook)

    return call


#: The process's reply loop.
REPLY_LOOP = ReplyLoop()

