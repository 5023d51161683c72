"""``GET /trees/{root_id}/stream``: a tree's text and transitions as Server-Sent Events.

The events (docs/api.md, "The stream"), each with an ``id:``:

- ``event: text``, ``data: {"task_id", "phase", "call", "attempt", "offset", "text"}``:
  a piece of a model call's output (``offset``: where it starts in that attempt's
  output, in characters);
- ``event: superseded``, ``data: {"task_id", "phase", "call", "attempt", "by"}``: a newer
  attempt of the call began (a retry, a re-delivery): drop the text of ``attempt``;
- ``event: transition``, ``data: {"task_id", "from", "to", "at", "agent"}``;
- last, ``event: end`` (no id), ``data: {"root_id", "status"}``: the root's terminal
  transition and everything before it were sent; the server closes the stream.

A reader that reconnects with ``Last-Event-ID`` (or ``?after=<id>``, for a first
connection) gets every later event once: the order and its gap-freedom are
:mod:`runtime.store.streams`'. A finished tree's stream is read from its start. While
nothing is new, a comment line (``: keepalive``) goes out every
:data:`KEEPALIVE_SECONDS` so proxies keep the connection.

Failure modes: 404 for a tree that does not exist, 422 for a malformed event id; the
database failing mid-stream closes the connection (the reader reconnects with its last
id); a tree pruned mid-stream ends it (``status`` null).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from fastapi import FastAPI, Header, Query
from fastapi.responses import StreamingResponse

from runtime.store.rows import NotFound
from runtime.store.store import Store
from runtime.store.streams import (
    EVENT_ID_PATTERN,
    POLL_SECONDS,
    Horizon,
    Position,
    StreamEvent,
    StreamReader,
    TreeStream,
)

#: Seconds of silence after which a comment line is sent (proxies drop idle streams).
KEEPALIVE_SECONDS = 15.0
#: The reconnection delay the server suggests to EventSource (``retry:``), milliseconds.
RETRY_MS = 1000
#: Threads that run the streams' reads (each one short transaction on a pooled
#: connection): at most this many of the API's connections ([database] pool_size, 10 by
#: default) serve streams at once, however many readers are connected.
READ_THREADS = 4
_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no",
            "X-Content-Type-Options": "nosniff"}


def sse(event: StreamEvent) -> bytes:
    """One event in the SSE wire format (its JSON on one ``data:`` line)."""
    data = json.dumps(event.data, ensure_ascii=False, separators=(",", ":"))
    return f"id: {event.id}\nevent: {event.kind}\ndata: {data}\n\n".encode()


def end_message(root_id: uuid.UUID, status: str | None) -> bytes:
    """The stream's last message: ``event: end`` (no id: it is no row of the tree)."""
    data = json.dumps({"root_id": str(root_id), "status": status})
    return f"event: end\ndata: {data}\n\n".encode()


async def sse_stream(reader: StreamReader, root_id: uuid.UUID, after: Position,
                     executor: ThreadPoolExecutor | None = None,
                     poll_seconds: float = POLL_SECONDS,
                     horizon: Horizon | None = None) -> AsyncIterator[bytes]:
    """The SSE body of a tree's stream after ``after``, until the stream ends.

    With a shared ``horizon``, the stream reads (on ``executor``) only when it moved;
    else each step probes it.
    """
    loop = asyncio.get_running_loop()
    stream = TreeStream(reader, root_id, after, poll_seconds)
    yield f"retry: {RETRY_MS}\n\n".encode()
    quiet_since = time.monotonic()
    if horizon is not None:
        horizon.subscribe()
    try:
        while not stream.ended:
            seen = horizon.value() if horizon is not None else None
            events = (await loop.run_in_executor(executor, stream.step, seen)
                      if stream.wants(seen) else [])
            if events:
                yield b"".join(sse(e) for e in events)
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= KEEPALIVE_SECONDS:
                yield b": keepalive\n\n"
                quiet_since = time.monotonic()
            if stream.waiting:
                await asyncio.sleep(stream.pause())
    finally:
        if horizon is not None:
            horizon.unsubscribe()
    status = None
    if stream.found:
        status = await loop.run_in_executor(executor, reader.root_status, root_id)
    yield end_message(root_id, status)


_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}},
          "description": "Server-Sent Events: text, superseded, transition, then end"},
    404: {"description": "no tree with that root"},
    422: {"description": "a malformed event id (Last-Event-ID or after)"},
}


def add_stream_routes(app: FastAPI, store: Store) -> None:
    """Add ``GET /trees/{root_id}/stream`` on ``store``."""
    reader = store.streams
    executor = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tree-stream")
    horizon = Horizon(reader)

    @app.get("/trees/{root_id}/stream", tags=["trees"], response_class=StreamingResponse,
             responses=_RESPONSES)
    async def stream_tree(
        root_id: uuid.UUID,
        last_event_id: Annotated[str, Header(
            alias="Last-Event-ID", max_length=64, pattern=EVENT_ID_PATTERN,
            description="Resume after this event (what EventSource sends).")] = "",
        after: Annotated[str, Query(
            max_length=64, pattern=EVENT_ID_PATTERN,
            description="Resume after this event id (a first connection; "
            "Last-Event-ID wins).")] = "",
    ) -> StreamingResponse:
        """A tree's model-call text as it grows and its transitions, as Server-Sent Events.

        Every event has an id; reconnect with ``Last-Event-ID`` to get every later event
        once. The stream ends (``event: end``) after the root's terminal transition.
        """
        position = Position.parse(last_event_id or after)
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(executor, reader.exists, root_id):
            raise NotFound(f"no tree with root {root_id}")
        return StreamingResponse(sse_stream(reader, root_id, position, executor,
                                            horizon=horizon),
                                 media_type="text/event-stream", headers=_HEADERS)
