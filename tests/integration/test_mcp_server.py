"""The MCP server face: ``orgchart mcp`` over stdio and ``/mcp`` over streamable HTTP.

Driven by the official Python MCP client (the SDK's ``ClientSession``) and by a client
nobody here wrote, the MCP Inspector's CLI mode (installed by ``make mcp-inspector``
under ``~/.cache/orgchart/npm``; its tests skip, saying so, when it is absent). The
trees run docs/writing-agents.md's ``ask_a_person`` example (a publisher that asks a
person), drained by a worker in the test process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
import uvicorn
from mcp import Client, ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from runtime.config import load_settings
from runtime.http.api import create_app
from runtime.mcp.mount import mount
from runtime.mcp.server import build_server
from runtime.store.call_text import TextPiece
from runtime.store.rows import NewTask
from runtime.store.store import Store
from runtime.wiring import Runtime, build_runtime
from tests.integration.test_docs_agents import code_blocks

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "mcp-test-token"
#: Seconds: the MCP SDK's default client timeouts (its ``streamable_http_client``'s own).
MCP_TIMEOUT_SECONDS, MCP_READ_TIMEOUT_SECONDS = 30.0, 300.0
TOOLS = {"submit_goal", "get_tree", "get_task", "list_inbox", "answer", "approve", "reject",
         "cancel", "pause", "resume", "fork"}
#: Where ``make mcp-inspector`` installs the Inspector (``ORGCHART_NPM_CACHE`` moves it).
INSPECTOR = Path(os.environ.get("ORGCHART_NPM_CACHE", Path.home() / ".cache/orgchart/npm")) \
    / "node_modules/.bin/mcp-inspector"


@pytest.fixture
def agents_dir(tmp_path: Path) -> Path:
    """A directory holding docs/writing-agents.md's ask_a_person.py, as written."""
    where = tmp_path / "agents"
    where.mkdir()
    (where / "ask_a_person.py").write_text(code_blocks("ask_a_person.py"), encoding="utf-8")
    return where


@pytest.fixture
def runtime(orgchart_env: dict[str, str], db_url: str, store: Store, agents_dir: Path
            ) -> Iterator[Runtime]:
    sys.path.insert(0, str(agents_dir))
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "offline"})
    yield build_runtime(settings, ["tests.support_agents", "ask_a_person"], store=store)
    sys.path.remove(str(agents_dir))


def drain(runtime: Runtime) -> None:
    """Run a worker in this process until nothing is left to claim."""
    worker = runtime.worker(None, maintenance=False, listen=False)
    for _ in range(50):
        if worker.run_once() == 0 and runtime.store.hygiene.sweep().ready == 0:
            return


@contextmanager
def background_worker(runtime: Runtime) -> Iterator[None]:
    """A worker running on its own thread (LISTEN wakes it) until the block ends."""
    worker = runtime.worker(None, poll_interval_seconds=0.1, maintenance_interval_seconds=0.5)
    thread = threading.Thread(target=worker.run, name="worker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        worker.stop("the test is over")
        thread.join(30)


def payload(result: types.CallToolResult) -> Any:
    assert not result.is_error, result.content
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return json.loads(block.text)


def refusal(result: types.CallToolResult) -> str:
    assert result.is_error
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


def stdio_params(env: dict[str, str], agents_dir: Path) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "runtime.cli", "mcp", "--agents-module", "ask_a_person",
              "--agents-module", "tests.support_agents"],
        env={**env, "PYTHONPATH": os.pathsep.join([str(agents_dir), str(ROOT)])},
        cwd=str(ROOT))


# ---------------------------------------------------------------- the session's steps
async def ask_and_answer(session: ClientSession, runtime: Runtime) -> str:
    """Submit the publisher's goal, answer its question over MCP; return the root id."""
    submitted = payload(await session.call_tool(
        "submit_goal", {"prompt": "the winter report", "agent": "publisher"}))
    assert submitted["created"] is True and submitted["status"] == "pending"
    root = submitted["id"]
    drain(runtime)
    inbox = payload(await session.call_tool("list_inbox", {}))["items"]
    ((question,),) = [[i for i in inbox if i["root_id"] == root]]
    assert question["kind"] == "question" and question["choices"] == ["yes", "no"]
    bad = refusal(await session.call_tool("answer", {"task_id": question["id"],
                                                     "answer": "maybe"}))
    assert "not one of the choices" in bad
    assert runtime.store.reads.get(uuid.UUID(question["id"]))["status"] == "pending"
    done = payload(await session.call_tool("answer", {"task_id": question["id"],
                                                      "answer": "yes", "by": "alice"}))
    assert done["changed"] is True and done["status"] == "done"
    return str(root)


async def bad_input_changes_nothing(session: ClientSession, runtime: Runtime) -> None:
    before = len(runtime.store.reads.recent_roots(500))
    unknown = refusal(await session.call_tool("submit_goal", {"prompt": "x",
                                                              "agent": "nobody"}))
    assert "nobody" in unknown
    extra = refusal(await session.call_tool("submit_goal", {"prompt": "x", "colour": 1}))
    assert extra == "arguments: unknown field 'colour'"
    malformed = refusal(await session.call_tool("cancel", {"task_id": "not-a-uuid"}))
    assert malformed.startswith("task id 'not-a-uuid' is not a UUID")
    missing = refusal(await session.call_tool("get_task", {"task_id": str(uuid.uuid4())}))
    assert missing.startswith("no task")
    assert len(runtime.store.reads.recent_roots(500)) == before


async def steer_a_tree(session: ClientSession, runtime: Runtime, done_root: str) -> None:
    """Idempotent submits, pause/resume/cancel, and a fork, as the CLI answers them."""
    args = {"prompt": "steer me", "agent": "echo", "idempotency_key": f"k-{uuid.uuid4()}"}
    first = payload(await session.call_tool("submit_goal", args))
    again = payload(await session.call_tool("submit_goal", args))
    assert (again["id"], again["created"]) == (first["id"], False)
    paused = payload(await session.call_tool("pause", {"root_id": first["id"], "note": "hold"}))
    assert paused["changed"] is True
    twice = payload(await session.call_tool("pause", {"root_id": first["id"]}))
    assert twice["changed"] is False and twice["message"]
    assert payload(await session.call_tool("resume", {"root_id": first["id"]}))["changed"]
    cancelled = payload(await session.call_tool("cancel", {"task_id": first["id"],
                                                           "by": "bob"}))
    assert cancelled["status"] == "cancelled"
    assert runtime.store.reads.events(uuid.UUID(first["id"]))[-1]["worker"] == "bob"
    branch = payload(await session.call_tool("fork", {"task_id": done_root}))
    assert branch["created"] is True and branch["id"] != done_root
    assert runtime.store.reads.get(uuid.UUID(branch["id"]))["status"] == "pending"


async def approve_and_reject(session: ClientSession, runtime: Runtime) -> None:
    """Roots held for approval: approved once, rejected with a note (required)."""
    runtime.store.policies.approval_agents = ("echo",)
    held = [payload(await session.call_tool("submit_goal", {"prompt": f"needs a yes {i}",
                                                            "agent": "echo"}))
            for i in range(2)]
    assert [h["status"] for h in held] == ["awaiting_approval"] * 2
    ok = payload(await session.call_tool("approve", {"task_id": held[0]["id"], "note": "ok"}))
    assert ok["changed"] is True and ok["status"] == "pending"
    again = payload(await session.call_tool("approve", {"task_id": held[0]["id"]}))
    assert again["changed"] is False and "nothing to approve" in again["message"]
    assert refusal(await session.call_tool("reject", {"task_id": held[1]["id"]}))
    assert runtime.store.reads.get(uuid.UUID(held[1]["id"]))["status"] == "awaiting_approval"
    no = payload(await session.call_tool("reject", {"task_id": held[1]["id"],
                                                    "note": "too dear"}))
    assert no["status"] == "failed"


# ---------------------------------------------------------------- stdio
def test_stdio_runs_a_tree_and_answers_its_question(
        runtime: Runtime, orgchart_env: dict[str, str], agents_dir: Path) -> None:
    async def main() -> None:
        async with stdio_client(stdio_params(orgchart_env, agents_dir)) as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            listed = await session.list_tools()
            assert {t.name for t in listed.tools} == TOOLS
            submit = next(t for t in listed.tools if t.name == "submit_goal")
            assert {"prompt", "agent", "tenant", "budget_usd", "idempotency_key",
                    "wait"} <= set(submit.input_schema["properties"])
            root = await ask_and_answer(session, runtime)
            drain(runtime)
            tree = payload(await session.call_tool("get_tree", {"root_id": root}))
            assert tree["status"] == "done" and "result" not in tree  # the summary shape
            read_back = await session.read_resource(f"orgchart://trees/{root}")
            content = read_back.contents[0]
            assert isinstance(content, types.TextResourceContents)
            assert json.loads(content.text)["result"] == {"text": "publish: yes"}
            listed_trees = (await session.list_resources()).resources
            assert f"orgchart://trees/{root}" in {str(r.uri) for r in listed_trees}
            templates = (await session.list_resource_templates()).resource_templates
            assert {t.uri_template for t in templates} == {"orgchart://trees/{root_id}",
                                                           "orgchart://tasks/{id}"}
            task = await session.read_resource(f"orgchart://tasks/{root}")
            assert isinstance(task.contents[0], types.TextResourceContents)
            assert json.loads(task.contents[0].text)["status"] == "done"
            await steer_a_tree(session, runtime, root)
            await bad_input_changes_nothing(session, runtime)

    anyio.run(main)


def test_a_modern_client_listens_to_a_tree_over_stdio(
        runtime: Runtime, orgchart_env: dict[str, str], agents_dir: Path) -> None:
    """The 2026-07-28 wire (``server/discover``, ``subscriptions/listen``): the high-level
    ``Client`` probes for it, and hears the tree change while a worker runs it."""

    async def main() -> None:
        async with Client(stdio_params(orgchart_env, agents_dir)) as client:
            assert client.protocol_version in MODERN_PROTOCOL_VERSIONS
            submitted = await client.call_tool("submit_goal", {"prompt": "hi", "agent": "echo"})
            uri = f"orgchart://trees/{payload(submitted)['id']}"
            heard = 0
            async with client.listen(resource_subscriptions=[uri]) as events:
                with background_worker(runtime), anyio.fail_after(30):
                    async for event in events:  # one per change the watcher saw
                        assert event.uri == uri  # type: ignore[union-attr]
                        heard += 1
                        tree = payload(await client.call_tool("get_tree",
                                                              {"root_id": uri[-36:]}))
                        if tree["status"] == "done":
                            break
            assert heard >= 1

    anyio.run(main)


# ---------------------------------------------------------------- streamable HTTP
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def http_url(runtime: Runtime) -> Iterator[str]:
    """``orgchart serve``'s app with ``/mcp`` mounted, on a real uvicorn on 127.0.0.1."""
    app = create_app(store=runtime.store, settings=runtime.settings,
                     registry=runtime.registry, api_token=TOKEN)
    mount(app, build_server(runtime.store, runtime.settings, runtime.registry))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/mcp"
    server.should_exit = True
    thread.join(10)


async def _http_session(stack: AsyncExitStack, url: str,
                        on_message: Callable[[Any], Awaitable[None]]) -> ClientSession:
    # The SDK's documented way to send headers: an httpx2 client of one's own, with the
    # timeouts its transports use by default (30 s, and 300 s to read a held stream).
    client = await stack.enter_async_context(httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=httpx2.Timeout(MCP_TIMEOUT_SECONDS, read=MCP_READ_TIMEOUT_SECONDS)))
    read, write = await stack.enter_async_context(
        streamable_http_client(url, http_client=client))
    session = await stack.enter_async_context(
        ClientSession(read, write, message_handler=on_message))
    await session.initialize()
    return session


def test_http_needs_the_token(http_url: str) -> None:
    response = httpx.post(http_url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert response.status_code == 401


# ClientSession speaks the 2025 wire, where resources/subscribe is how one subscribes.
@pytest.mark.filterwarnings("ignore:resources/subscribe is removed")
def test_http_waits_for_the_tree_with_progress_and_resource_updates(
        runtime: Runtime, http_url: str) -> None:
    updated: list[str] = []
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ResourceUpdatedNotification):
            updated.append(str(message.params.uri))

    async def on_progress(done: float, total: float | None, text: str | None) -> None:
        progress.append((done, total, text))

    async def main() -> None:
        async with AsyncExitStack() as stack:
            session = await _http_session(stack, http_url, on_message)
            assert {t.name for t in (await session.list_tools()).tools} == TOOLS
            root = await ask_and_answer(session, runtime)
            await session.subscribe_resource(f"orgchart://trees/{root}")
            with background_worker(runtime):
                ended = payload(await session.call_tool(
                    "submit_goal", {"prompt": "echo me", "agent": "echo", "wait": True,
                                    "timeout_seconds": 30},
                    progress_callback=on_progress))
                assert ended["ended"] is True and ended["status"] == "done"
                assert ended["result"]["echo"] == "echo me"
                deadline = time.monotonic() + 30
                while f"orgchart://trees/{root}" not in updated:
                    assert time.monotonic() < deadline, "no resources/updated notification"
                    await anyio.sleep(0.05)
            assert runtime.store.reads.get(uuid.UUID(root))["status"] == "done"
            await approve_and_reject(session, runtime)
            await bad_input_changes_nothing(session, runtime)

    anyio.run(main)
    assert progress and progress[-1] == (1, 1, "root done: 1 of 1 tasks ended")


@pytest.mark.filterwarnings("ignore:resources/subscribe is removed")
def test_a_subscribed_tree_updates_as_a_running_call_streams(
        runtime: Runtime, http_url: str) -> None:
    """Pieces of a running task's call, with no transition between them, each bring a
    ``resources/updated``, and the tree resource shows the text so far (``streaming``)."""
    store = runtime.store
    root, _ = store.tasks.submit(NewTask(to_agent="echo", type="task", payload={"goal": "g"}))
    [claimed] = store.claims.claim(["echo"], 1, "test", 300)
    uri = f"orgchart://trees/{root['id']}"
    updates: list[str] = []

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ResourceUpdatedNotification):
            updates.append(str(message.params.uri))

    def piece(attempt: int | None, offset: int, text: str) -> TextPiece:
        return TextPiece(root["id"], claimed["lease_token"], "run", 0, attempt, 0, offset,
                         text)

    async def streamed(session: ClientSession) -> Any:
        content = (await session.read_resource(uri)).contents[0]
        assert isinstance(content, types.TextResourceContents)
        return json.loads(content.text)["streaming"]

    async def main() -> None:
        async with AsyncExitStack() as stack:
            session = await _http_session(stack, http_url, on_message)
            await session.subscribe_resource(uri)
            assert await streamed(session) == []
            transitions = store.reads.tree_changes(root["id"], 0)
            text = ""
            for n, word in enumerate(["Once ", "upon ", "a time"]):
                outcome = store.call_text.write([piece(1 if n else None, len(text), word)])
                assert outcome[0].ours and outcome[0].attempt == 1
                text += word
                with anyio.fail_after(10):  # the watcher polls every 0.5 s
                    while len(updates) <= n:
                        await anyio.sleep(0.02)
                assert updates[n] == uri
                assert await streamed(session) == [{
                    "task_id": str(root["id"]), "phase": "run", "call": 0, "attempt": 1,
                    "text": text}]
            assert store.reads.tree_changes(root["id"], 0) == transitions  # text alone, no move

    anyio.run(main)


# ---------------------------------------------------------------- the MCP Inspector
def _inspector(target: tuple[list[str], list[str]], *options: str,
               env: dict[str, str] | None = None) -> Any:
    """Run the Inspector's CLI mode and read its JSON.

    ``target`` is what goes before the method's options (the server's URL, headers,
    ``-e`` variables) and what goes after them (``-- command args``): ``--tool-arg``
    and ``--header`` take every value up to the next option.
    """
    if not INSPECTOR.exists() or shutil.which("node") is None:
        pytest.skip(f"the MCP Inspector is not installed at {INSPECTOR} "
                    "(run `make mcp-inspector`; it needs node and npm)")
    done = subprocess.run([str(INSPECTOR), "--cli", *target[0], *options, *target[1]],
                          capture_output=True,
                          text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return json.loads(done.stdout)


def _inspect_both(target: tuple[list[str], list[str]], env: dict[str, str] | None) -> None:
    listed = _inspector(target, "--method", "tools/list", env=env)
    assert {t["name"] for t in listed["tools"]} == TOOLS
    called = _inspector(target, "--method", "tools/call", "--tool-name", "submit_goal",
                        "--tool-arg", "prompt=from the inspector", "agent=publisher", env=env)
    assert called.get("isError") in (None, False), called
    task = json.loads(called["content"][0]["text"])
    assert task["created"] is True and task["agent"] == "publisher"


def test_the_inspector_lists_and_calls_the_tools_over_stdio(
        runtime: Runtime, orgchart_env: dict[str, str], agents_dir: Path) -> None:
    params = stdio_params(orgchart_env, agents_dir)
    env_args = [a for k, v in (params.env or {}).items() if k.startswith(("ORGCHART_",
                                                                         "PYTHONPATH"))
                for a in ("-e", f"{k}={v}")]
    _inspect_both(([*env_args, "--cwd", str(ROOT)], ["--", params.command, *params.args]),
                  {**os.environ, "HOME": os.environ.get("HOME", "/tmp")})


def test_the_inspector_lists_and_calls_the_tools_over_http(http_url: str) -> None:
    _inspect_both((["--server-url", http_url, "--transport", "http", "--header",
                    f"Authorization: Bearer {TOKEN}"], []), None)
