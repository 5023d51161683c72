"""What the lean transport must do like httpx's own: reconnect, framing, redirects, proxies.

Each test talks to a loopback server of a few lines written here (raw sockets, so the
bytes on the wire are exactly the ones the test names).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import ollama
import pytest

from runtime.llm.backends.ollama import OllamaBackend
from runtime.llm.loop import CallLoop
from runtime.llm.reply import RetryableModelError

MODEL = "llama3.2:latest"
MESSAGES = [{"role": "user", "content": "Name two competitors of Acme Robotics"}]
CHAT = json.dumps({"model": MODEL, "created_at": "2026-01-01T00:00:00Z",
                   "message": {"role": "assistant", "content": "fake: two"},
                   "done": True, "done_reason": "stop", "prompt_eval_count": 3,
                   "eval_count": 2}).encode()


def answer(body: bytes = CHAT, extra: bytes = b"") -> bytes:
    """A whole keep-alive HTTP/1.1 response carrying ``body``."""
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def read_request(conn: socket.socket) -> bytes:
    """One request (head and Content-Length body) from ``conn``; b"" at EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(65536)
        if not piece:
            return b""
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    size = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            size = int(value)
    while len(body) < size:
        body += conn.recv(65536)
    return head


@contextlib.contextmanager
def serving(handle: Callable[[socket.socket, int], None]) -> Iterator[tuple[str, list[int]]]:
    """Run ``handle(conn, n)`` for the n-th connection; yield the URL and a count box."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = [0]

    def loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            n, accepted[0] = accepted[0], accepted[0] + 1
            threading.Thread(target=_run, args=(handle, conn, n), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        listener.close()


def _run(handle: Callable[[socket.socket, int], None], conn: socket.socket, n: int) -> None:
    with contextlib.suppress(OSError), conn:
        handle(conn, n)


def chat_once(url: str, **backend: Any) -> ollama.ChatResponse:
    """One chat through the backend's client (the lean path), on a fresh loop."""
    async def run() -> ollama.ChatResponse:
        client = OllamaBackend(url, 3.0, **backend).new_client(url, 2)
        try:
            return await client.chat(model=MODEL, messages=MESSAGES)
        finally:
            await client.close()
    return asyncio.run(run())


def test_a_stale_keep_alive_connection_is_replaced_and_the_call_succeeds() -> None:
    def handle(conn: socket.socket, n: int) -> None:
        read_request(conn)
        conn.sendall(answer())  # keep-alive: the client pools this connection
        if n == 0:
            read_request(conn)  # the server gave up on it: closes without a byte
            return
        while read_request(conn):
            conn.sendall(answer())

    async def two(url: str) -> list[str]:
        client = OllamaBackend(url, 3.0).new_client(url, 1)
        try:
            return [(await client.chat(model=MODEL, messages=MESSAGES)).message.content or ""
                    for _ in range(2)]
        finally:
            await client.close()

    with serving(handle) as (url, accepted):
        assert asyncio.run(two(url)) == ["fake: two", "fake: two"]
        assert accepted[0] == 2  # the second call reconnected


def chunked(*chunks: bytes) -> bytes:
    """A chunked HTTP/1.1 response head followed by ``chunks`` as given (raw)."""
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(chunks))


@pytest.mark.parametrize(("raw", "says"), [
    # a chunk's data is not followed by CRLF
    (chunked(b"%x\r\n" % len(CHAT), CHAT, b"XX0\r\n\r\n"), "CRLF"),
    # a chunk size with a sign (int(..., 16) would take it)
    (chunked(b"+%x\r\n" % len(CHAT), CHAT, b"\r\n0\r\n\r\n"), "chunk size"),
    # the last chunk's line is not followed by the blank line (or trailers)
    (chunked(b"%x\r\n" % len(CHAT), CHAT, b"\r\n0\r\nXX"), "closed"),
])
def test_malformed_chunked_framing_is_refused(raw: bytes, says: str) -> None:
    def handle(conn: socket.socket, n: int) -> None:
        read_request(conn)
        conn.sendall(raw)

    with serving(handle) as (url, _), pytest.raises(httpx.RemoteProtocolError) as caught:
        chat_once(url)
    assert says in str(caught.value)


def test_well_formed_chunks_with_extensions_and_trailers_are_read() -> None:
    half = len(CHAT) // 2
    raw = chunked(b"%x;name=value\r\n" % half, CHAT[:half], b"\r\n",
                  b"%X\r\n" % (len(CHAT) - half), CHAT[half:], b"\r\n",
                  b"0\r\nX-Trailer: 1\r\n\r\n")

    def handle(conn: socket.socket, n: int) -> None:
        read_request(conn)
        conn.sendall(raw)

    with serving(handle) as (url, _):
        assert chat_once(url).message.content == "fake: two"


@pytest.mark.parametrize("raw", [
    # one head of 2,000 short header lines (about 80 KB)
    b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-Filler-%04d: %s\r\n" % (i, b"v" * 24)
                                      for i in range(2000)) + b"Content-Length: 0\r\n\r\n",
    # 4,000 interim responses (about 100 KB of heads) before the real one
    b"HTTP/1.1 100 Continue\r\n\r\n" * 4000 + answer(),
])
def test_an_oversized_response_head_is_refused(raw: bytes) -> None:
    def handle(conn: socket.socket, n: int) -> None:
        read_request(conn)
        conn.sendall(raw)

    with serving(handle) as (url, _), pytest.raises(httpx.RemoteProtocolError) as caught:
        chat_once(url)
    assert "response head is larger than" in str(caught.value)


@pytest.mark.parametrize("status", [307, 308])
def test_a_redirect_is_followed_with_the_same_request(status: int) -> None:
    seen: list[bytes] = []

    def target(conn: socket.socket, n: int) -> None:
        while head := read_request(conn):
            seen.append(head.split(b"\r\n")[0])
            conn.sendall(answer())

    with serving(target) as (target_url, _):
        def moved(conn: socket.socket, n: int) -> None:
            read_request(conn)
            conn.sendall(b"HTTP/1.1 %d Moved\r\nLocation: %s/api/chat\r\n"
                         b"Content-Length: 0\r\n\r\n" % (status, target_url.encode()))

        with serving(moved) as (url, _):
            assert chat_once(url).message.content == "fake: two"
    assert seen == [b"POST /api/chat HTTP/1.1"]


@pytest.fixture
def proxy() -> Iterator[tuple[str, list[bytes]]]:
    """A loopback forward proxy that answers every request itself; yields URL and lines."""
    lines: list[bytes] = []

    def handle(conn: socket.socket, n: int) -> None:
        while head := read_request(conn):
            lines.append(head.split(b"\r\n")[0])
            conn.sendall(answer())

    with serving(handle) as (url, _):
        yield url, lines


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy",
                 "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_http_proxy_from_the_environment_carries_the_call(
        proxy: tuple[str, list[bytes]], no_proxy_env: pytest.MonkeyPatch) -> None:
    proxy_url, lines = proxy
    no_proxy_env.setenv("HTTP_PROXY", proxy_url)
    # model.invalid resolves nowhere: only the proxy can answer
    assert chat_once("http://model.invalid:11434").message.content == "fake: two"
    assert lines == [b"POST http://model.invalid:11434/api/chat HTTP/1.1"]


def test_no_proxy_sends_the_call_straight_to_the_server(
        proxy: tuple[str, list[bytes]], no_proxy_env: pytest.MonkeyPatch) -> None:
    proxy_url, lines = proxy
    direct: list[bytes] = []

    def handle(conn: socket.socket, n: int) -> None:
        while head := read_request(conn):
            direct.append(head.split(b"\r\n")[0])
            conn.sendall(answer())

    no_proxy_env.setenv("HTTP_PROXY", proxy_url)
    no_proxy_env.setenv("NO_PROXY", "localhost,127.0.0.1")
    with serving(handle) as (url, _):
        assert chat_once(url).message.content == "fake: two"
    assert lines == [] and direct == [b"POST /api/chat HTTP/1.1"]


def test_one_limit_per_server_and_route_for_the_slots_and_the_pool() -> None:
    calls = CallLoop()
    backend = OllamaBackend("http://127.0.0.1:1", 3.0, max_parallel=3, cloud_max_parallel=5)

    async def gates() -> None:
        local = backend.parallel_for("local")
        # one gate per server and route (every model shares it), as large as its pool
        assert calls.slot(backend.host_for("local"), local) is \
            calls.slot(backend.host_for("local"), local)
        client = backend.client_for("local")
        assert client.http.pool.max_connections == local
        cloud = backend.client_for("cloud")  # the same server, the cloud route's limit
        assert cloud is not client
        assert cloud.http.pool.max_connections == 5
        await backend.aclose()

    asyncio.run(gates())


def test_a_pool_timeout_says_it_waited_for_a_slot() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    backend = OllamaBackend(url, 5.0, max_parallel=1)

    async def calls() -> None:
        backend.client_for("local").http.timeout = httpx.Timeout(5.0, pool=0.2)
        first = asyncio.ensure_future(backend.achat(MODEL, MESSAGES, None, 8))
        await asyncio.sleep(0.05)
        try:
            with pytest.raises(RetryableModelError, match=r"waited 0\.2 s for a free connection"):
                await backend.achat(MODEL, MESSAGES, None, 8)
        finally:
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await first
            await backend.aclose()

    try:
        asyncio.run(calls())
    finally:
        listener.close()


@pytest.mark.parametrize(("no_proxy", "url", "straight"), [
    ("", "http://model.example:11434", False),
    ("*", "http://model.example:11434", True),
    ("localhost,127.0.0.1", "http://127.0.0.1:11434", True),
    ("localhost,127.0.0.1", "http://localhost:11434", True),
    ("example.com", "http://model.example.com:11434", True),
    ("example.com", "http://example.com", True),
    ("example.com", "http://notexample.com", False),
    (".example.com", "http://model.example.com", True),
    ("::1", "http://[::1]:11434", True),
    ("https://model.example", "http://model.example", False),
])
def test_the_environments_proxies_send_a_url_as_httpx_would(
        no_proxy: str, url: str, straight: bool) -> None:
    from runtime.llm.backends.transport import environment_mounts, goes_straight

    proxies = {"http": "http://proxy.invalid:3128", "no": no_proxy}
    mounts = environment_mounts(proxies, httpx.Limits())
    assert goes_straight(httpx.URL(url), mounts) is straight
    # httpx itself, given the same mounts (the same patterns, each to a proxy or to None),
    # sends the call through a proxy exactly when we do not go straight: each transport
    # answers with its name.
    def answers(name: str) -> httpx.MockTransport:
        return httpx.MockTransport(lambda _request: httpx.Response(200, text=name))

    with httpx.Client(transport=answers("straight"), mounts={
            pattern: None if proxy is None else answers("proxy")
            for pattern, proxy in mounts.items()}) as client:
        assert (client.get(url).text == "straight") is straight
