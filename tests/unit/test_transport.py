"""The Ollama backend's HTTP transport against real loopback servers (no database).

The fake Ollama answers in HTTP/1.0 (one connection per request); ``bench.model_server``
keeps connections alive (HTTP/1.1). Both go through ``LeanAsyncClient``'s lean path and
through httpx's ordinary path (a streamed chat).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from runtime.llm.backends.ollama import OllamaBackend
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

MODEL = "llama3.2:latest"
MESSAGES = [{"role": "user", "content": "Name two competitors of Acme Robotics"}]


@pytest.fixture
def keep_alive_server() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.model_server", "--delay", "0"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    try:
        assert line.startswith("port "), line
        yield f"http://127.0.0.1:{line.split()[1]}"
    finally:
        proc.kill()
        proc.wait()


def test_a_streamed_chat_and_a_whole_one_say_the_same(fake_ollama: FakeOllama) -> None:
    async def both() -> tuple[str, str]:
        client = OllamaBackend(fake_ollama.url, 5.0).new_client(fake_ollama.url, 4)
        try:
            parts = [p.message.content async for p in
                     await client.chat(model=MODEL, messages=MESSAGES, stream=True)]
            whole = await client.chat(model=MODEL, messages=MESSAGES, stream=False)
        finally:
            await client.close()
        return "".join(p or "" for p in parts), whole.message.content or ""

    streamed, whole = asyncio.run(both())
    assert streamed == whole and whole.startswith("fake: ")


def test_connections_are_kept_alive_and_bounded(keep_alive_server: str) -> None:
    async def calls() -> tuple[int, int]:
        backend = OllamaBackend(keep_alive_server, 5.0, max_parallel=3)
        client = backend.new_client(keep_alive_server, 3)
        pool = client.http.pool
        try:
            for _ in range(5):  # one after another: one connection, reused
                await client.chat(model=MODEL, messages=MESSAGES)
            sequential = pool.idle_connections
            await asyncio.gather(*(client.chat(model=MODEL, messages=MESSAGES)
                                   for _ in range(10)))
            gathered = pool.idle_connections
        finally:
            await client.close()
        return sequential, gathered

    sequential, gathered = asyncio.run(calls())
    assert sequential == 1 and gathered == 3  # ten calls at once over at most three


def test_a_refused_connection_is_an_httpx_connect_error_and_frees_its_slot() -> None:
    async def calls() -> list[BaseException]:
        # One connection allowed: a failed connect that kept its slot would make the
        # second call wait for the pool (a PoolTimeout) instead of failing to connect.
        client = OllamaBackend("http://127.0.0.1:9", 2.0).new_client("http://127.0.0.1:9", 1)
        errors: list[BaseException] = []
        try:
            for _ in range(2):
                try:
                    await client.chat(model=MODEL, messages=MESSAGES)
                except BaseException as exc:
                    errors.append(exc)
        finally:
            await client.close()
        return errors

    errors = asyncio.run(calls())
    assert len(errors) == 2
    assert all(isinstance(e, (ConnectionError, httpx.ConnectError)) for e in errors), errors


@contextlib.contextmanager
def _one_answer(raw: bytes) -> Iterator[str]:
    """A server that answers one request with ``raw`` bytes and hangs up; yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(raw)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


async def _connections_free(client: Any) -> int:
    """How many of two calls at once get a connection of ``client`` (pool timeout 0.2 s).

    The server never answers them: a call that got a connection hangs until it is cut at
    0.6 s; one that got none fails at the pool timeout first.
    """
    async def one() -> str:
        try:
            await asyncio.wait_for(client.chat(model=MODEL, messages=MESSAGES), 0.6)
        except httpx.PoolTimeout:
            return "no connection"
        except TimeoutError:
            return "connected"
        return "answered"

    return list(await asyncio.gather(one(), one())).count("connected")


def _one_connection(url: str, timeout: httpx.Timeout) -> Any:
    """The backend's client to ``url`` with one connection and ``timeout``."""
    client = OllamaBackend(url, 5.0).new_client(url, 1)
    client.http.timeout = timeout
    return client


def test_a_call_waits_for_a_free_connection_up_to_the_pool_timeout() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def calls() -> None:
        client = _one_connection(url, httpx.Timeout(5.0, pool=0.2))
        try:
            first = asyncio.ensure_future(client.chat(model=MODEL, messages=MESSAGES))
            await asyncio.sleep(0.05)  # the first call holds the only connection
            with pytest.raises(httpx.PoolTimeout):
                await client.chat(model=MODEL, messages=MESSAGES)
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            assert await _connections_free(client) == 1  # the cancelled call's came back
        finally:
            await client.close()

    try:
        asyncio.run(calls())
    finally:
        listener.close()


@pytest.mark.parametrize(("raw", "error"), [
    # promises 100 bytes, sends 10 and hangs up
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789", httpx.RemoteProtocolError),
    # a whole body that cannot be decoded (after the connection was given back)
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\n\r\nnot-z",
     httpx.DecodingError),
])
def test_a_broken_body_is_an_httpx_error_and_frees_its_slot_once(
        raw: bytes, error: type[Exception]) -> None:
    async def call(url: str) -> None:
        client = _one_connection(url, httpx.Timeout(2.0, pool=0.2))
        try:
            with pytest.raises(error):
                await client.chat(model=MODEL, messages=MESSAGES)
            # given back once: one call gets it (the server takes it and never answers)
            assert await _connections_free(client) == 1
        finally:
            await client.close()

    with _one_answer(raw) as url:
        asyncio.run(call(url))


@pytest.mark.parametrize("schema", [None, {"type": "object", "required": ["a"],
                                           "properties": {"a": {"type": "string"}}}])
@pytest.mark.parametrize("think", [False, True])
def test_text_chat_sends_the_body_the_official_chat_sends(fake_ollama: FakeOllama,
                                                          schema: dict[str, Any] | None,
                                                          think: bool) -> None:
    """The bodies as the server reads them: the official ``chat``'s, then ``text_chat``'s."""
    client = OllamaBackend(fake_ollama.url, 5.0).new_client(fake_ollama.url, 1)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": ""},  # an empty reply echoed in a repair
                {"role": "user", "content": "again, as JSON"}]
    options = {"num_predict": 7}

    async def both() -> None:
        try:
            await client.chat(model=MODEL, messages=messages, format=schema or None,
                              options=options, stream=False, think=think)
            await client.text_chat(MODEL, messages, schema, options, think)
        finally:
            await client.close()

    asyncio.run(both())
    official, ours = fake_ollama.requests
    assert ours == official
