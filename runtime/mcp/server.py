"""The MCP server: the SDK's low-level ``Server`` wired to the tools and the resources.

:func:`build_server` makes one; :func:`run_stdio` serves it on stdin/stdout
(``orgchart mcp``); :func:`mount` adds it to the HTTP API at ``/mcp`` (streamable
HTTP, ``orgchart serve``), where the API's bearer-token guard covers it like every
other path. The low-level server (not ``MCPServer``) because the tools' input schemas
are the API's pydantic models, validated by us so that bad input is a tool error
(``isError``) with the message the CLI prints, never a protocol error.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import mcp.types as types
import sqlalchemy as sa
from mcp.server import Server, ServerRequestContext
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ResourceUpdated

from agents.registry import Registry
from runtime.config import Settings
from runtime.core.dberrors import one_line
from runtime.mcp import resources
from runtime.mcp.tools import (
    TOOLS,
    TOOLS_BY_NAME,
    Deps,
    GetTaskArgs,
    SubmitGoalArgs,
    ToolRefused,
    get_task,
    parse_arguments,
    root_progress,
    run_tool,
)
from runtime.store.postgres.failover import DatabaseUnavailable
from runtime.store.rows import TERMINAL_STATUSES
from runtime.store.store import Store
from runtime.store.streams import TreeStream

log = logging.getLogger(__name__)

#: How long ``orgchart mcp --worker`` gives its worker to hand back what it holds.
WORKER_STOP_SECONDS = 30.0
#: How often a ``submit_goal`` with ``wait`` reads its tree (and may send progress).
WAIT_POLL_SECONDS = 0.5
#: How often it reads the tree's stream for the model calls' text (with a progress token).
TEXT_POLL_SECONDS = 0.1
#: Characters of text after which the progress fraction of :class:`_TextProgress` is 1/2.
TEXT_PROGRESS_CHARS = 1000
INSTRUCTIONS = (
    "orgchart runs trees of agents on PostgreSQL. submit_goal starts a tree (wait=true "
    "returns when it ends); get_tree and the orgchart://trees/{root_id} resource show it; "
    "list_inbox shows the questions and approvals that wait for a person; answer, approve "
    "and reject act on them."
)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _result(value: Any) -> types.CallToolResult:
    text = _text(value)
    structured = json.loads(text)
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                structured_content=structured
                                if isinstance(structured, dict) else None)


def _refusal(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)],
                                is_error=True)


async def wait_with_progress(ctx: ServerRequestContext[Any], store: Store, root_id: uuid.UUID,
                             timeout: float) -> bool:
    """Poll the tree until its root ends or ``timeout``; send progress on each change.

    With a progress token, the model calls' text goes out too, as it streams: one
    notification per call per read of the tree's stream (every
    :data:`TEXT_POLL_SECONDS`), its ``message`` the text (:class:`_TextProgress`).
    """
    token = (ctx.meta or {}).get("progress_token")
    deadline = time.monotonic() + timeout
    last: tuple[str, int, int] | None = None
    text = _TextProgress(store, root_id) if token is not None else None
    next_read = 0.0
    while True:
        if time.monotonic() >= next_read:
            status, ended, total = await anyio.to_thread.run_sync(root_progress, store,
                                                                  root_id)
            next_read = time.monotonic() + WAIT_POLL_SECONDS
        if text is not None and token is not None:
            for message in await anyio.to_thread.run_sync(text.messages):
                await ctx.session.send_progress_notification(
                    token, text.progress(ended), total, message=message,
                    related_request_id=str(ctx.request_id))
        if token is not None and (status, ended, total) != last:
            done = status in TERMINAL_STATUSES
            await ctx.session.send_progress_notification(
                token, ended if done or text is None else text.progress(ended), total,
                message=f"root {status}: {ended} of {total} tasks ended",
                related_request_id=str(ctx.request_id))
        last = (status, ended, total)
        if status in TERMINAL_STATUSES:
            return True
        if time.monotonic() >= deadline:
            return False
        await anyio.sleep(TEXT_POLL_SECONDS if text is not None else WAIT_POLL_SECONDS)


class _TextProgress:
    """A tree's streamed text as progress messages (``submit_goal`` with ``wait``).

    Each message is one call's new text, headed ``<agent> <task id[:8]> <phase> call
    <n>:`` (``superseded`` notices likewise). :meth:`progress` keeps the progress value
    rising with every message while staying below the next task's end: the tasks ended,
    plus a fraction that grows with the characters sent.
    """

    def __init__(self, store: Store, root_id: uuid.UUID) -> None:
        self.stream = TreeStream(store.streams, root_id)
        self.agents: dict[str, str] = {}
        self.chars = 0

    def progress(self, ended: int) -> float:
        """``ended`` plus a fraction below 1 that grows with the characters sent."""
        return ended + self.chars / (self.chars + TEXT_PROGRESS_CHARS)

    def messages(self) -> list[str]:
        """The text that became readable since the last call, one message per call."""
        if self.stream.ended:
            return []
        messages: list[str] = []
        current: tuple[str, str, int, int] | None = None
        for event in self.stream.step():
            data = event.data
            if event.kind == "transition":
                self.agents[data["task_id"]] = str(data.get("agent") or "")
                continue
            head = (f"{self.agents.get(data['task_id'], '')} {data['task_id'][:8]} "
                    f"{data['phase']} call {data['call']}").lstrip()
            if event.kind == "superseded":
                messages.append(f"{head}: attempt {data['attempt']} superseded by attempt "
                                f"{data['by']}")
                current = None
                continue
            key = (data["task_id"], data["phase"], data["call"], data["attempt"])
            self.chars += len(data["text"])
            if key == current:
                messages[-1] += data["text"]
            else:
                messages.append(f"{head}: {data['text']}")
                current = key
        return messages


class _Handlers:
    """The request handlers of one server, over one set of dependencies."""

    def __init__(self, deps: Deps, watcher: resources.Watcher,
                 bus: InMemorySubscriptionBus) -> None:
        self.deps = deps
        self.watcher = watcher
        self.bus = bus
        self.listen = ListenHandler(bus)

    async def list_tools(self, _ctx: Any, _params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[
            types.Tool(name=t.name, description=t.description,
                       input_schema=t.model.model_json_schema(),
                       annotations=types.ToolAnnotations(read_only_hint=t.read_only))
            for t in TOOLS])

    async def call_tool(self, ctx: ServerRequestContext[Any],
                        params: types.CallToolRequestParams) -> types.CallToolResult:
        spec = TOOLS_BY_NAME.get(params.name)
        if spec is None:
            return _refusal(f"no tool {params.name!r}; the tools are "
                            f"{', '.join(TOOLS_BY_NAME)}")
        try:
            args = parse_arguments(spec, params.arguments)
            value = await anyio.to_thread.run_sync(run_tool, self.deps, spec, args)
            if isinstance(args, SubmitGoalArgs) and args.wait:
                root = uuid.UUID(value["id"])
                ended = await wait_with_progress(ctx, self.deps.store, root, args.timeout_seconds)
                detail = await anyio.to_thread.run_sync(
                    get_task, self.deps, GetTaskArgs(task_id=str(root)))
                value = {**detail, "created": value["created"], "ended": ended,
                         **({"warning": value["warning"]} if "warning" in value else {})}
        except ToolRefused as exc:
            return _refusal(str(exc))
        except DatabaseUnavailable as exc:  # its message names the server already
            return _refusal(str(exc))
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            log.warning("database unavailable", extra={"error": str(exc)[:500]})
            return _refusal(f"database unavailable: {one_line(exc)}")
        except Exception:
            log.exception("tool %s failed", params.name)
            return _refusal("internal error (the server's log has the traceback)")
        return _result(value)

    async def list_resources(self, _ctx: Any, _params: Any) -> types.ListResourcesResult:
        roots = await anyio.to_thread.run_sync(self.deps.store.reads.recent_roots, 20)
        return types.ListResourcesResult(resources=[
            types.Resource(uri=resources.TREE_TEMPLATE.format(root_id=r["id"]),
                           name=f"tree {r['id']}", mime_type="application/json",
                           description=f"{r['to_agent']}: {r['status']}")
            for r in roots])

    async def list_templates(self, _ctx: Any, _params: Any) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=[
            types.ResourceTemplate(**t) for t in resources.templates()])

    async def read_resource(self, _ctx: Any, params: types.ReadResourceRequestParams
                            ) -> types.ReadResourceResult:
        uri = str(params.uri)
        text = await anyio.to_thread.run_sync(resources.read, self.deps.store, uri)
        return types.ReadResourceResult(contents=[types.TextResourceContents(
            uri=uri, mime_type="application/json", text=text)])

    async def subscribe(self, ctx: ServerRequestContext[Any],
                        params: types.SubscribeRequestParams) -> types.EmptyResult:
        session = ctx.session
        await self.watcher.add(str(params.uri), session, session.send_resource_updated)
        return types.EmptyResult()

    async def unsubscribe(self, ctx: ServerRequestContext[Any],
                          params: types.UnsubscribeRequestParams) -> types.EmptyResult:
        self.watcher.remove(str(params.uri), ctx.session)
        return types.EmptyResult()

    async def subscriptions_listen(self, ctx: ServerRequestContext[Any],
                                   params: types.SubscriptionsListenRequestParams
                                   ) -> types.SubscriptionsListenResult:
        """A ``subscriptions/listen`` stream: watch its URIs while it is open."""
        key = object()
        uris = [str(u) for u in params.notifications.resource_subscriptions or ()]

        async def publish(uri: str) -> None:
            await self.bus.publish(ResourceUpdated(uri=uri))

        try:
            for uri in uris:
                await self.watcher.add(uri, key, publish)
            return await self.listen(ctx, params)
        finally:
            for uri in uris:
                self.watcher.remove(uri, key)


def build_server(store: Store, settings: Settings, registry: Registry) -> Server[Any]:
    """The MCP server over ``store``: the tools, the resources and their watcher."""
    watcher = resources.Watcher(store)
    handlers = _Handlers(Deps(store, registry, settings), watcher, InMemorySubscriptionBus())

    @asynccontextmanager
    async def lifespan(_: Server[Any]) -> AsyncIterator[dict[str, Any]]:
        async with anyio.create_task_group() as group:
            group.start_soon(watcher.run)
            yield {}
            group.cancel_scope.cancel()

    return Server(
        "orgchart", version="0.1.0", instructions=INSTRUCTIONS, lifespan=lifespan,
        on_list_tools=handlers.list_tools, on_call_tool=handlers.call_tool,
        on_list_resources=handlers.list_resources,
        on_list_resource_templates=handlers.list_templates,
        on_read_resource=handlers.read_resource,
        on_subscribe_resource=handlers.subscribe,
        on_unsubscribe_resource=handlers.unsubscribe,
        on_subscriptions_listen=handlers.subscriptions_listen,
    )


def run_stdio(server: Server[Any]) -> None:
    """Serve ``server`` on stdin/stdout until the client closes stdin."""
    from mcp.server.stdio import stdio_server

    async def main() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)


def serve_stdio(settings: Settings, modules: list[str], worker: bool = False) -> None:
    """``orgchart mcp``: serve on stdin/stdout; with ``worker``, run a worker here too.

    The worker (every registered agent and the judge stage, ``[worker]`` settings) runs
    on a thread of this process for as long as the server does, so a single-machine host
    (Claude Desktop, Cursor) needs no other process for ``submit_goal`` to end. It stops
    when stdin closes, handing back what it holds.
    """
    import threading

    from runtime.wiring import build_runtime, load_registry, open_store

    store = open_store(settings)
    stop: list[tuple[Any, threading.Thread]] = []
    try:
        if worker:
            runtime = build_runtime(settings, modules, store=store)
            running = runtime.worker()
            thread = threading.Thread(target=running.run, name="mcp worker", daemon=True)
            thread.start()
            stop.append((running, thread))
            registry = runtime.registry
        else:
            registry = load_registry(settings, modules)
        run_stdio(build_server(store, settings, registry))
    finally:
        for running, thread in stop:
            running.stop("the MCP client closed stdin")
            thread.join(timeout=WORKER_STOP_SECONDS)
        store.dispose()
