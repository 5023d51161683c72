"""A streamed reply read off a chunked body, however its bytes are cut (transport.py).

A loopback server sends an Ollama-style NDJSON reply, chunked, cut into pieces of every
size from one byte up (each piece its own write, so the client reads them one by one):
the text handed on and the reply put together are the same every time.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from runtime.llm.backends.ollama import OllamaBackend

LINES = [{"model": "m", "created_at": "2026-12-07T00:00:00Z", "done": False,
          "message": {"role": "assistant", "content": f"piece {n}, "}} for n in range(12)]
LAST = {"model": "m", "created_at": "2026-12-07T00:00:00Z", "done": True,
        "done_reason": "stop", "message": {"role": "assistant", "content": ""},
        "prompt_eval_count": 3, "eval_count": 24}


def _body() -> bytes:
    chunks = b""
    for n, line in enumerate([*LINES, LAST]):
        data = json.dumps(line).encode() + b"\n"
        ext = b";n=1" if n == 3 else b""  # a chunk extension, ignored
        chunks += b"%x%s\r\n%s\r\n" % (len(data), ext, data)
    return chunks + b"0\r\nX-Trailer: yes\r\n\r\n"


@pytest.mark.parametrize("cut", [1, 2, 7, 64, 100_000])
def test_a_chunked_stream_cut_anywhere_reads_the_same(cut: int) -> None:
    raw = (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + _body())

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for i in range(0, len(raw), cut):
            writer.write(raw[i:i + cut])
            await writer.drain()
            await asyncio.sleep(0.0005 if cut < 100 else 0)
        writer.close()

    async def run() -> tuple[list[str], str]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = OllamaBackend(url, 5.0).new_client(url, 1)
        pieces: list[str] = []
        try:
            reply = await client.text_chat_streamed("m", [{"role": "user", "content": "hi"}],
                                                    None, {}, False, (), pieces.append)
        finally:
            await client.close()
            server.close()
        return pieces, reply.message.content or ""

    pieces, content = asyncio.run(run())
    assert pieces == [str(line["message"]["content"]) for line in LINES]  # type: ignore[index]
    assert content == "".join(pieces)
