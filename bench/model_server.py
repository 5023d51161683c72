"""A loopback Ollama-compatible server that answers every chat after a fixed delay.

    python -m bench.model_server [--port 0] [--delay 1.0] [--pieces 0]

Prints ``port N`` once it listens. Speaks just enough HTTP/1.1 (keep-alive,
``Content-Length`` bodies) for the official client: ``POST /api/chat`` (non-streaming;
a ``format`` schema gets ``{}``-shaped JSON text, which the bench agents do not use),
``GET /api/tags``, ``GET /api/version``; and ``GET /stats`` (calls answered, calls in
flight now, peak in flight, calls aborted by their client), ``GET /starts`` (when each
call started) and ``POST /stats/reset`` for the benchmark. One asyncio loop,
no thread per connection, so a thousand concurrent calls cost a thousand sockets.
With ``--pieces N`` (N > 0), a chat that asks ``"stream": true`` is answered as Ollama
streams: NDJSON lines, chunked, N pieces of the answer spread over the delay, then the
last line with the counts (``[streaming]``'s cost, docs/streaming.md); 0: one body.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import resource
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Counts:
    """What the server saw."""

    answered: int = 0
    in_flight: int = 0
    peak: int = 0
    #: Calls whose client hung up before the answer (a cancelled task's call, aborted).
    aborted: int = 0

    def as_dict(self) -> dict[str, int]:
        """JSON-ready."""
        return {"answered": self.answered, "in_flight": self.in_flight, "peak": self.peak,
                "aborted": self.aborted}


def raise_open_files_limit() -> int:
    """Raise the soft limit of open files to the hard limit (a thousand sockets); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _response(status: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


def _chunk(writer: asyncio.StreamWriter, line: dict[str, Any]) -> None:
    """Write one NDJSON line as one HTTP chunk."""
    data = json.dumps(line).encode() + b"\n"
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


class ModelServer:
    """The server: ``delay`` seconds per chat, counting calls in flight."""

    def __init__(self, delay: float, pieces: int = 0) -> None:
        self.delay = delay
        #: A streamed chat's pieces (0: a streamed chat gets the whole answer at once).
        self.pieces = pieces
        self.counts = Counts()
        #: When each chat started (``time.time()``, this machine's clock), in order.
        self.starts: list[float] = []
        #: When each aborted chat's client hung up, and when each answered chat ended.
        self.aborts: list[float] = []
        self.ends: list[float] = []

    async def chat(self, request: dict[str, Any]) -> dict[str, Any]:
        """One chat: wait ``delay``, answer with token counts like Ollama's."""
        self.starts.append(time.time())
        c = self.counts
        c.in_flight += 1
        c.peak = max(c.peak, c.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            c.in_flight -= 1
        c.answered += 1
        self.ends.append(time.time())
        prompt = " ".join(str(m.get("content", "")) for m in request.get("messages", []))
        text = json.dumps({"text": "ok"}) if request.get("format") else "ok: an answer"
        return {
            "model": request.get("model", "bench"),
            "created_at": dt.datetime.now(dt.UTC).isoformat(),
            "message": {"role": "assistant", "content": text},
            "done": True, "done_reason": "stop",
            "total_duration": int(self.delay * 1e9), "load_duration": 0,
            "prompt_eval_count": max(1, len(prompt) // 4), "prompt_eval_duration": 0,
            "eval_count": 4, "eval_duration": int(self.delay * 1e9),
        }

    async def stream_chat(self, request: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        """One chat streamed as Ollama does: ``pieces`` NDJSON lines over the delay, then the
        last one (``done``, the counts). Counted as :meth:`chat` counts."""
        self.starts.append(time.time())
        c = self.counts
        c.in_flight += 1
        c.peak = max(c.peak, c.in_flight)
        model = request.get("model", "bench")
        now = dt.datetime.now(dt.UTC).isoformat()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            for n in range(self.pieces):
                # On a schedule from the start (a model's fixed pace): a late wake-up of
                # this busy loop does not push every later piece back.
                await asyncio.sleep(max(0.0, began + (n + 1) * self.delay / self.pieces
                                        - loop.time()))
                _chunk(writer, {"model": model, "created_at": now, "done": False,
                                "message": {"role": "assistant", "content": f"piece {n}. "}})
                await writer.drain()
        finally:
            c.in_flight -= 1
        c.answered += 1
        self.ends.append(time.time())
        prompt = " ".join(str(m.get("content", "")) for m in request.get("messages", []))
        _chunk(writer, {"model": model, "created_at": now, "done": True,
                        "done_reason": "stop", "message": {"role": "assistant", "content": ""},
                        "prompt_eval_count": max(1, len(prompt) // 4),
                        "eval_count": 2 * self.pieces})
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def route(self, method: str, path: str, body: bytes) -> bytes:
        """Answer one request."""
        if method == "POST" and path == "/api/chat":
            return _response("200 OK", await self.chat(json.loads(body or b"{}")))
        if path == "/api/tags":
            return _response("200 OK", {"models": [{"name": "llama3.2:latest"},
                                                   {"name": "qwen3:14b"}]})
        if path == "/api/version":
            return _response("200 OK", {"version": "0.6.0"})
        if path == "/stats":
            return _response("200 OK", self.counts.as_dict())
        if path == "/stats/reset":
            self.counts = Counts(in_flight=self.counts.in_flight)
            self.starts, self.aborts, self.ends = [], [], []
            return _response("200 OK", self.counts.as_dict())
        if path == "/starts":  # when each chat since the last reset started (or was aborted)
            return _response("200 OK", {"starts": self.starts, "aborts": self.aborts,
                                        "ends": self.ends})
        return _response("404 Not Found", {"error": f"no {path}"})

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one keep-alive connection."""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in lines[1:] if line)}
                size = int(headers.get("content-length", "0"))
                body = await reader.readexactly(size) if size else b""
                if self.pieces and method == "POST" and path == "/api/chat":
                    request = json.loads(body or b"{}")
                    if request.get("stream"):
                        await self.stream_chat(request, writer)
                        continue
                answer = await self._answer_unless_gone(reader, method, path.split("?")[0],
                                                        body)
                if answer is None:
                    break  # the client hung up while it waited: its call was aborted
                writer.write(answer)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


    async def _answer_unless_gone(self, reader: asyncio.StreamReader, method: str, path: str,
                                  body: bytes) -> bytes | None:
        """Answer, or None when the client closes the connection first (counted aborted).

        The client sends nothing more on a connection until it has its answer, so a read
        that returns while the answer is being made is the connection's end.
        """
        answering = asyncio.ensure_future(self.route(method, path, body))
        closing = asyncio.ensure_future(reader.read(1))
        done, _ = await asyncio.wait({answering, closing},
                                     return_when=asyncio.FIRST_COMPLETED)
        if answering in done:
            closing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await closing  # the stream has one reader at a time
            return answering.result()
        answering.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answering
        self.counts.aborted += 1
        self.aborts.append(time.time())
        return None


async def serve(port: int, delay: float, pieces: int = 0) -> None:
    """Listen on loopback and serve forever."""
    server = ModelServer(delay, pieces)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", port, backlog=4096)
    print(f"port {listener.sockets[0].getsockname()[1]}", flush=True)
    async with listener:
        await listener.serve_forever()


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--pieces", type=int, default=0)
    args = parser.parse_args(argv)
    raise_open_files_limit()
    asyncio.run(serve(args.port, args.delay, args.pieces))


if __name__ == "__main__":
    main()
