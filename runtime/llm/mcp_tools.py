"""Tools from Model Context Protocol servers over stdio, through the official ``mcp`` SDK.

``[mcp.servers.<name>] command = [...]`` in ``orgchart.toml`` names a server; its
``agents`` get its tools in ``ctx.tools``. :class:`McpToolSource` starts each server the
first time its tools are needed, on a loop of its own (a daemon thread): an MCP session
lives in one event loop, and tool calls arrive from the worker's loop, the model layer's
loop or a test's. A tool is an ``async`` :class:`agents.tools.Tool` whose parameters are
the server's JSON schema; its calls go through the same durable-step path as any tool
(recorded, replayed, fenced). A call that the server reports as an error raises
:class:`McpToolError` (the model is told); a server that does not start or answer within
``timeout_seconds`` raises :class:`McpUnavailable`.

**A server that dies is started again.** Each call first pings the server (one small
request over its pipe); when the process is gone (it crashed, it was killed) the call
starts a new one, up to :data:`RESTART_ATTEMPTS` times with a doubling wait from
:data:`RESTART_BACKOFF_SECONDS`, then runs on it; when it keeps dying the call raises
:class:`McpUnavailable` saying so. A server that dies *during* a call is not asked again
by that call (the tool may have run: its step records the error, the model is told, and
a redelivery runs the step again with its idempotency key); the next call restarts it.
Concurrent calls restart a dead server once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from agents.tools import Tool
from runtime.config import McpServerSettings, Settings
from runtime.core import backoff
from runtime.errors import OrgchartError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Starts of a dead server one call tries before it gives up.
RESTART_ATTEMPTS = 3
#: The wait before the second start (doubling for each next one; none before the first).
RESTART_BACKOFF_SECONDS = 0.2
#: The MCP error code of a closed connection (JSON-RPC ``-32000`` in the SDK).
CONNECTION_CLOSED = -32000


class McpUnavailable(OrgchartError):
    """An MCP server did not start, or did not answer in time."""


class McpToolError(OrgchartError):
    """An MCP server answered a tool call with an error."""


def _result_value(result: Any) -> Any:
    """The JSON value of a ``CallToolResult``: its structured content, else its text."""
    structured = getattr(result, "structured_content", None)
    if structured is None:
        structured = getattr(result, "structuredContent", None)
    texts = [getattr(c, "text", "") for c in getattr(result, "content", None) or []]
    if getattr(result, "is_error", getattr(result, "isError", False)):
        raise McpToolError("; ".join(t for t in texts if t) or "the MCP tool failed")
    if isinstance(structured, dict):
        # The SDK wraps a plain return value as {"result": value}.
        return structured.get("result", structured) if len(structured) == 1 else structured
    return "\n".join(texts)


def _reason(error: BaseException) -> str:
    """An error in a few words: the first error inside nested exception groups."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"


class _Server:
    """One running MCP server: its session, kept open by a task on the source's loop."""

    def __init__(self, name: str, config: McpServerSettings) -> None:
        self.name = name
        self.config = config
        self.session: Any = None
        self.tools: list[Any] = []
        self.stop = asyncio.Event()
        self.ready = asyncio.Event()
        self.error: BaseException | None = None
        self.task: asyncio.Future[None] | None = None
        #: Set when its connection was found closed (the process died): start another.
        self.dead = False

    @property
    def command(self) -> str:
        """The server's command line, for messages."""
        return " ".join(self.config.command)

    async def serve(self) -> None:
        """Start the server, list its tools, and hold the session until told to stop."""
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        params = StdioServerParameters(command=self.config.command[0],
                                       args=list(self.config.command[1:]),
                                       env=dict(self.config.env) or None)
        try:
            async with stdio_client(params) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                self.tools = list((await session.list_tools()).tools)
                self.session = session
                self.ready.set()
                await self.stop.wait()
        except BaseException as exc:
            self.error = exc
            self.ready.set()


class McpToolSource:
    """The MCP servers of ``[mcp]``, started on first use; their tools per agent."""

    def __init__(self, settings: Settings) -> None:
        self.servers = dict(settings.mcp.servers)
        self._running: dict[str, _Server] = {}
        self._tools: dict[str, tuple[Tool, ...]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._restarting: dict[str, asyncio.Lock] = {}  # on the source's loop
        #: How often each server was started again after it died.
        self.restarts: dict[str, int] = {}

    def tools_for(self, agent: str) -> tuple[Tool, ...]:
        """The MCP tools configured for ``agent`` (its servers are started now if needed)."""
        names = [n for n, s in self.servers.items() if agent in s.agents]
        return tuple(t for name in names for t in self.server_tools(name))

    def server_tools(self, name: str) -> tuple[Tool, ...]:
        """The tools of one configured server, as :class:`~agents.tools.Tool` objects."""
        with self._lock:
            if name not in self._tools:
                server = self._start(name)
                self._tools[name] = tuple(self._tool(server, t) for t in server.tools)
            return self._tools[name]

    def _start(self, name: str) -> _Server:
        loop = self._ensure_loop()
        return asyncio.run_coroutine_threadsafe(self._started(name), loop).result()

    async def _started(self, name: str) -> _Server:
        """Start server ``name`` on the source's loop; wait until its tools are listed."""
        server = _Server(name, self.servers[name])
        self._running[name] = server
        server.task = asyncio.ensure_future(server.serve())
        try:
            await asyncio.wait_for(server.ready.wait(), server.config.timeout_seconds)
        except TimeoutError:
            server.stop.set()
            raise McpUnavailable(f"MCP server {name!r} ({server.command}) did not start "
                                 f"within {server.config.timeout_seconds:g} s") from None
        if server.error is not None:
            raise McpUnavailable(f"MCP server {name!r} ({server.command}) could not start: "
                                 f"{_reason(server.error)}") from server.error
        return server

    async def _live(self, name: str) -> _Server:
        """Server ``name`` alive (pinged), started again if it died (on the source's loop)."""
        lock = self._restarting.setdefault(name, asyncio.Lock())
        async with lock:  # concurrent calls that find it dead restart it once
            server = self._running.get(name)
            if server is not None and not server.dead and server.session is not None:
                try:
                    await asyncio.wait_for(server.session.send_ping(),
                                           server.config.timeout_seconds)
                    return server
                except Exception as exc:  # closed, or not answering: start another
                    log.warning("MCP server %r did not answer a ping (%s); starting it "
                                "again", name, exc)
            return await self._restart(name, server)

    async def _restart(self, name: str, dead: _Server | None) -> _Server:
        if dead is not None:
            dead.dead = True
            dead.stop.set()  # its session closes; its process, if any, is ended
        error: BaseException | None = None
        for attempt in range(RESTART_ATTEMPTS):
            if attempt:
                await asyncio.sleep(backoff.delay(attempt - 1, RESTART_BACKOFF_SECONDS))
            try:
                server = await self._started(name)
            except McpUnavailable as exc:
                error = exc
                continue
            self.restarts[name] = self.restarts.get(name, 0) + 1
            log.warning("MCP server %r started again (restart %d)", name, self.restarts[name])
            return server
        config = self.servers[name]
        raise McpUnavailable(f"MCP server {name!r} ({' '.join(config.command)}) keeps dying: "
                             f"{RESTART_ATTEMPTS} starts failed; last: {error}") from error

    async def _call(self, name: str, tool: str, arguments: dict[str, Any]) -> Any:
        """One tool call on a live server (on the source's loop)."""
        server = await self._live(name)
        try:
            return await asyncio.wait_for(server.session.call_tool(tool, arguments),
                                          server.config.timeout_seconds)
        except TimeoutError:
            raise
        except Exception as exc:
            if getattr(exc, "code", None) != CONNECTION_CLOSED:
                raise
            server.dead = True
            raise McpUnavailable(f"MCP server {name!r} ({server.command}) closed the "
                                 f"connection during tool {tool!r} (it may have run); it is "
                                 "started again on the next call") from exc

    def _tool(self, server: _Server, spec: Any) -> Tool:
        schema = getattr(spec, "input_schema", None) or getattr(spec, "inputSchema", None)
        timeout = server.config.timeout_seconds
        name = server.name

        # The ping, the starts of a dead server (each within the timeout, with the waits
        # between them) and the call itself: each step is bounded, and so is the whole.
        bound = timeout * (RESTART_ATTEMPTS + 2) + RESTART_BACKOFF_SECONDS * 2 ** RESTART_ATTEMPTS

        async def call(**arguments: Any) -> Any:
            return await self._on_loop(self._call(name, spec.name, arguments),
                                       bound, f"tool {spec.name!r} of {name!r}")

        call.__name__ = spec.name
        return Tool(spec.name, spec.description or "", None, call,
                    parameters=dict(schema or {"type": "object"}),
                    source=f"mcp:{server.name}")

    async def _on_loop(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> Any:
        loop = self._ensure_loop()
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), loop)
        try:
            return _result_value(await asyncio.wrap_future(future))
        except TimeoutError:
            raise McpUnavailable(f"MCP {what} did not answer in time") from None

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="mcp-tools", daemon=True).start()
            self._loop = loop
        return self._loop

    def close(self) -> None:
        """Stop every server started (their processes end) and the source's loop."""
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def stop_all() -> None:
            for server in self._running.values():
                server.stop.set()
            await asyncio.sleep(0.2)  # let each session close and its process exit

        try:
            asyncio.run_coroutine_threadsafe(stop_all(), loop).result(10)
        except Exception:  # the loop is stopped below either way; say what was left
            log.warning("MCP servers did not all stop within 10 s: %s", sorted(self._running),
                        exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        self._running.clear()
        self._tools.clear()
