"""``orgchart.AsyncClient``: the :class:`~orgchart.client.Client` for asyncio code.

The same calls, awaited: each blocking call of the client's door (the database or the
HTTP API) runs in a thread (``asyncio.to_thread``), and :meth:`AsyncRun.wait` sleeps on
the loop between two reads of the root, so the loop stays free while a tree runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from types import TracebackType
from typing import Any

from orgchart.client import (
    FIRST_WAIT_POLL_SECONDS,
    MAX_WAIT_POLL_SECONDS,
    Client,
    Run,
    as_id,
)
from orgchart.transports import Transport
from runtime.store.streams import StreamEvent

#: What the stream's thread hands the loop when the stream ended.
_END = object()


@dataclass(frozen=True)
class _Failed:
    """The stream's thread failed: the reader raises ``error``."""

    error: BaseException


class AsyncRun:
    """A :class:`~orgchart.client.Run` to await: ``id``, ``status``, ``result``...

    Its attributes read the wrapped :attr:`run` (as :class:`~orgchart.client.Run`'s).
    """

    def __init__(self, run: Run) -> None:
        self.run = run

    @property
    def id(self) -> uuid.UUID:
        """The root task's id."""
        return self.run.id

    @property
    def status(self) -> str:
        """The root's status when last read."""
        return self.run.status

    @property
    def result(self) -> Any:
        """The root's result (the answer) once done."""
        return self.run.result

    @property
    def error(self) -> str | None:
        """Why the root failed or escalated."""
        return self.run.error

    @property
    def cost_usd(self) -> Decimal:
        """What the whole tree spent, in dollars."""
        return self.run.cost_usd

    @property
    def spent_tokens(self) -> int:
        """The tokens the whole tree spent."""
        return self.run.spent_tokens

    @property
    def served_by(self) -> dict[str, int]:
        """Model calls per backend that served them."""
        return self.run.served_by

    @property
    def created(self) -> bool:
        """False when an idempotency key returned an earlier submission."""
        return self.run.created

    @property
    def warning(self) -> str | None:
        """Set by ``submit`` when no live worker would run the goal."""
        return self.run.warning

    @property
    def finished(self) -> bool:
        """Whether the root has ended."""
        return self.run.finished

    async def refresh(self) -> AsyncRun:
        """Read the root again; return this run."""
        await asyncio.to_thread(self.run.refresh)
        return self

    async def wait(self, timeout: float | None = None) -> AsyncRun:
        """Wait until the root ends; return this run, finished.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the tree goes on running).

        """
        transport: Transport = self.run.transport
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = FIRST_WAIT_POLL_SECONDS
        while True:
            self.run.status = await asyncio.to_thread(transport.status, self.run.id)
            if self.run.finished:
                return await self.refresh()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.run.id} is still {self.run.status} after "
                                   f"{timeout:g}s")
            await asyncio.sleep(pause)
            pause = min(pause * 2, MAX_WAIT_POLL_SECONDS)

    async def tree(self) -> dict[str, Any]:
        """The whole tree as nested JSON."""
        return await asyncio.to_thread(self.run.tree)

    async def cancel(self, note: str | None = None) -> dict[str, Any]:
        """Cancel the tree (every open task)."""
        return await asyncio.to_thread(self.run.cancel, note)

    async def pause(self, note: str | None = None) -> dict[str, Any]:
        """Pause the tree until :meth:`resume`."""
        return await asyncio.to_thread(self.run.pause, note)

    async def resume(self) -> dict[str, Any]:
        """Resume the paused tree."""
        return await asyncio.to_thread(self.run.resume)

    def __repr__(self) -> str:
        return f"Async{self.run!r}"


class AsyncClient:
    """:class:`~orgchart.client.Client`'s calls, awaited (same arguments, same errors).

    ``AsyncClient(database_url=None, *, config=None)`` or ``AsyncClient.http(url,
    token=None)``. Opening the database (and the embedded server) happens here, once.
    """

    def __init__(self, database_url: str | None = None, *, config: str | None = None,
                 client: Client | None = None) -> None:
        self.client = client or Client(database_url, config=config)

    @classmethod
    def http(cls, url: str, token: str | None = None, *, http_client: Any = None
             ) -> AsyncClient:
        """A client of ``orgchart serve`` at ``url`` (see :meth:`Client.http`)."""
        return cls(client=Client.http(url, token, http_client=http_client))

    async def submit(self, goal: str, agent: str = "ceo", **options: Any) -> AsyncRun:
        """Submit a root goal (:meth:`Client.submit`'s options); its run, at once."""
        return AsyncRun(await asyncio.to_thread(self.client.submit, goal, agent, **options))

    async def run(self, goal: str, agent: str = "ceo", *, timeout: float | None = None,
                  max_in_flight: int | None = None, **options: Any) -> AsyncRun:
        """Submit and run the tree in this process (a thread); the finished run."""
        run = await asyncio.to_thread(self.client.run, goal, agent, timeout=timeout,
                                      max_in_flight=max_in_flight, **options)
        return AsyncRun(run)

    async def get(self, root_id: uuid.UUID | str) -> AsyncRun:
        """The run of a tree submitted earlier, read now."""
        return AsyncRun(await asyncio.to_thread(self.client.get, as_id(root_id)))

    async def inbox(self) -> list[dict[str, Any]]:
        """What waits for a person, oldest first."""
        return await asyncio.to_thread(self.client.inbox)

    async def answer(self, task_id: uuid.UUID | str, answer: Any, *, by: str | None = None
                     ) -> dict[str, Any]:
        """Answer a question to ``human``."""
        return await asyncio.to_thread(self.client.answer, task_id, answer, by=by)

    async def stream(self, root_id: uuid.UUID | str, *, after: str | None = None
                     ) -> AsyncIterator[StreamEvent]:
        """A tree's events as they happen (:meth:`Client.stream`'s), to ``async for``.

        The blocking reads run on a thread of their own; each event is handed to the loop
        as it comes. Leaving the loop early stops the thread at its next read.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stopped = threading.Event()

        def hand(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is reading
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def pump() -> None:
            try:
                for event in self.client.stream(root_id, after=after, stop=stopped.is_set):
                    hand(event)
            except BaseException as exc:  # handed to the reader, raised there
                hand(_Failed(exc))
            else:
                hand(_END)

        thread = threading.Thread(target=pump, name=f"stream {root_id}", daemon=True)
        thread.start()
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            stopped.set()

    async def close(self) -> None:
        """Release the connections."""
        await asyncio.to_thread(self.client.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        await self.close()
