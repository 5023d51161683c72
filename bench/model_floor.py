"""The model layer's floor under the makespan tree: its model calls, without the engine.

    python -m bench.model_floor --url URL [--calls 900] [--client official|bare]

The makespan tree (``bench.makespan``) makes ``calls`` model calls at once (its writers),
then one more (the planner's aggregate): two calls of ``delay`` seconds on the critical
path. This makes the same calls against a loopback server at ``URL`` (``bench.model_server``,
started by ``bench.makespan``) from one fresh process, with no database, no agents and no engine:

- ``official``: through :class:`runtime.llm.backends.ollama.OllamaBackend` (the official
  ``ollama.AsyncClient`` on our transport: what a worker uses);
- ``bare``: raw asyncio streams speaking just enough HTTP/1.1 (no client library): the
  least any Python client on this machine can spend.

The time from the first call to the end of the last one, over the critical path, is the
floor of ``makespan_vs_critical_path`` on this machine: what is left above it is the
engine's. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from typing import Any

from bench.model_server import raise_open_files_limit

MESSAGES = [{"role": "user", "content": "lead 7 part 12"}]


async def _bare_call(host: str, port: int, request: bytes) -> dict[str, Any]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        size = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                size = int(value)
        body: dict[str, Any] = json.loads(await reader.readexactly(size))
        return body
    finally:
        writer.close()


def _bare(url: str) -> Any:
    host, _, port = url.removeprefix("http://").partition(":")
    body = json.dumps({"model": "llama3.2", "messages": MESSAGES, "stream": False}).encode()
    request = (f"POST /api/chat HTTP/1.1\r\nHost: {host}:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body

    async def call() -> Any:
        return await _bare_call(host, int(port), request)

    return call, None


def _official(url: str, calls: int) -> Any:
    from runtime.llm.backends.ollama import OllamaBackend

    backend = OllamaBackend(url, timeout_seconds=120.0)
    backend.parallel_for = lambda route: calls + 1  # type: ignore[method-assign]

    async def call() -> Any:
        return await backend.achat("llama3.2", MESSAGES, None, 8, route="local", think=False)

    return call, backend


async def measure(url: str, calls: int, client: str) -> dict[str, Any]:
    """``calls`` calls at once, then one more; wall and CPU seconds."""
    call, backend = _bare(url) if client == "bare" else _official(url, calls)
    cpu = time.process_time()
    started = time.monotonic()
    await asyncio.gather(*(call() for _ in range(calls)))
    burst = time.monotonic() - started
    await call()
    total = time.monotonic() - started
    cpu = time.process_time() - cpu
    if backend is not None:
        await backend.aclose()
    return {"client": client, "calls": calls + 1, "burst_seconds": round(burst, 3),
            "seconds": round(total, 3), "cpu_ms_per_call": round(cpu / (calls + 1) * 1000, 3)}


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: the model server runs separately (``--url``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--calls", type=int, default=900)
    parser.add_argument("--client", choices=("official", "bare"), default="official")
    args = parser.parse_args(argv)
    raise_open_files_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > args.calls
    print(json.dumps(asyncio.run(measure(args.url, args.calls, args.client))), flush=True)


if __name__ == "__main__":
    main()
