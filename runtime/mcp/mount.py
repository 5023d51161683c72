"""``/mcp`` on the HTTP API: the MCP server over streamable HTTP.

:func:`mount` adds the path to an app built by :func:`runtime.http.api.create_app`, so
the API's guard (the bearer token of ``ORGCHART_API_TOKEN``, the body limit) wraps it
like every other path, and starts the SDK's session manager with the app's lifespan.
Sessions are stateful (``Mcp-Session-Id``): a ``submit_goal`` that waits streams its
progress, and a subscription hears its resource change, on the session's event stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from mcp.server import Server
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.routing import Route

#: Where the MCP server answers on the HTTP API.
MCP_PATH = "/mcp"


def _security(loopback: bool) -> TransportSecuritySettings | None:
    """The SDK's Host and Origin checks, for a loopback listener only.

    A page on another site must not reach a loopback server through a name that
    resolves to 127.0.0.1 (DNS rebinding); beyond loopback the bearer token is required
    instead (``orgchart serve`` refuses to start without it).
    """
    if not loopback:
        return None
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
        allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
    )


def mount(app: FastAPI, server: Server[Any], loopback: bool = True) -> None:
    """Serve ``server`` at :data:`MCP_PATH` on ``app`` (before the app starts).

    Args:
        app: the HTTP API.
        server: the MCP server (:func:`runtime.mcp.server.build_server`).
        loopback: the app listens on a loopback address only (turns on the SDK's
            Host and Origin checks).

    """
    manager = StreamableHTTPSessionManager(app=server, security_settings=_security(loopback))
    app.router.routes.append(Route(MCP_PATH, endpoint=StreamableHTTPASGIApp(manager),
                                   methods=["GET", "POST", "DELETE"]))
    outer = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(started: Any) -> AsyncIterator[Any]:
        async with outer(started) as state, manager.run():
            yield state

    app.router.lifespan_context = lifespan
