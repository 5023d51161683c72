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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from agents.tools import Tool
from runtime.config import McpServerSettings, Settings
from runtime.errors import OrgchartError

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        config = self.servers[name]
        loop = self._ensure_loop()
        server = _Server(name, config)
        self._running[name] = server

        async def started() -> None:
            server.task = asyncio.ensure_future(server.serve())
            await asyncio.wait_for(server.ready.wait(), config.timeout_seconds)

        try:
            asyncio.run_coroutine_threadsafe(started(), loop).result()
        except TimeoutError:
            raise McpUnavailable(f"MCP server {name!r} ({' '.join(config.command)}) did not "
                                 f"start within {config.timeout_seconds:g} s") from None
        if server.error is not None:
            raise McpUnavailable(f"MCP server {name!r} ({' '.join(config.command)}) could "
                                 f"not start: {server.error}") from server.error
        return server

    def _tool(self, server: _Server, spec: Any) -> Tool:
        schema = getattr(spec, "input_schema", None) or getattr(spec, "inputSchema", None)
        timeout = server.config.timeout_seconds

        async def call(**arguments: Any) -> Any:
            return await self._on_loop(server.session.call_tool(spec.name, arguments),
                                       timeout, f"tool {spec.name!r} of {server.name!r}")

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
            raise McpUnavailable(f"MCP {what} did not answer within {timeout:g} s") from None

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

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop_all(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._running.clear()
        self._tools.clear()
