"""The model client's HTTP transport: httpx's own (tuned limits) against ours, same run.

    python -m bench.transport [--calls 900] [--sequential 300] [--rounds 2] [--delay 0.5]

Both clients are the official ``ollama.AsyncClient`` sending the body a worker sends
(``POST /api/chat``, non-streaming) to ``bench.model_server`` on loopback:

- ``httpx``: ``ollama.AsyncClient`` on ``httpx.AsyncClient`` with its default transport
  (httpcore and anyio), tuned with ``httpx.Limits(max_connections=calls,
  max_keepalive_connections=calls, keepalive_expiry=30)``;
- ``lean``: :class:`runtime.llm.backends.ollama.OllamaBackend`'s client, the same
  official client on :class:`runtime.llm.backends.transport.LeanAsyncClient`.

Per round and client, alternating (``rounds`` times): ``calls`` calls gathered at once
against a server that holds each ``delay`` seconds (every call on a new connection:
calls/s and CPU per call of this process), the same burst again on the kept-alive
connections, then ``sequential`` calls one after another against a server that answers
at once (p50/p99 latency, CPU per call). Prints one JSON object (medians over the
rounds; every round's figures are in ``transport_by_round``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from bench.model_server import raise_open_files_limit

MESSAGES = [{"role": "user", "content": "lead 7 part 12: write the section on pricing"}]
BODY: dict[str, Any] = {"model": "llama3.2", "stream": False, "options": {"num_predict": 8},
                        "tools": [], "think": False, "messages": MESSAGES}
CLIENTS = ("httpx", "lean")


@contextlib.contextmanager
def model_server(delay: float) -> Iterator[str]:
    """Start ``bench.model_server`` with ``delay``; yield its URL; stop it."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.model_server", "--delay",
                             str(delay)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("port "):
            raise RuntimeError(f"the model server did not start: {line!r}")
        yield f"http://127.0.0.1:{line.split()[1]}"
    finally:
        proc.kill()
        proc.wait()


def make_client(kind: str, url: str, connections: int) -> Any:
    """An ``ollama.AsyncClient`` on httpx's transport or on ours."""
    import httpx
    import ollama

    if kind == "lean":
        from runtime.llm.backends.ollama import OllamaBackend

        return OllamaBackend(url, 120.0).new_client(url, connections)
    limits = httpx.Limits(max_connections=connections,
                          max_keepalive_connections=connections, keepalive_expiry=30.0)
    return ollama.AsyncClient(host=url, timeout=120.0, limits=limits)


def chat(client: Any) -> Callable[[], Awaitable[Any]]:
    """One call as a worker makes it: ``chat()``'s body, parsed into a ChatResponse."""
    import ollama

    async def call() -> Any:
        return await client._request(ollama.ChatResponse, "POST", "/api/chat",
                                     json=BODY, stream=False)
    return call


async def burst(call: Callable[[], Awaitable[Any]], calls: int) -> dict[str, float]:
    """``calls`` calls at once: wall seconds, calls/s, CPU ms per call."""
    cpu, started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(call() for _ in range(calls)))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"seconds": round(wall, 3), "calls_per_s": round(calls / wall, 1),
            "cpu_ms_per_call": round(cpu / calls * 1000, 3)}


async def sequential(call: Callable[[], Awaitable[Any]], calls: int) -> dict[str, float]:
    """``calls`` calls one after another on a kept-alive connection: p50/p99, CPU."""
    await call()  # the connection
    lat: list[float] = []
    cpu = time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        await call()
        lat.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu
    lat.sort()
    return {"p50_ms": round(lat[len(lat) // 2] * 1000, 3),
            "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 3),
            "calls_per_s": round(calls / sum(lat), 1),
            "cpu_ms_per_call": round(cpu / calls * 1000, 3)}


async def one_round(kind: str, slow_url: str, fast_url: str, calls: int,
                    seq: int) -> dict[str, Any]:
    """One client's figures: a cold burst, a warm burst, sequential latency."""
    client = make_client(kind, slow_url, calls)
    try:
        cold = await burst(chat(client), calls)
        warm = await burst(chat(client), calls)
    finally:
        await client._client.aclose()
    client = make_client(kind, fast_url, calls)
    try:
        seq_figures = await sequential(chat(client), seq)
    finally:
        await client._client.aclose()
    return {"burst_new_connections": cold, "burst_kept_alive": warm,
            "sequential": seq_figures}


def _median(values: list[float]) -> float:
    ordered, mid = sorted(values), len(values) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return round((ordered[mid - 1] + ordered[mid]) / 2, 3)


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds, per client and figure."""
    out: dict[str, Any] = {}
    for kind in CLIENTS:
        mine = [r[kind] for r in rounds]
        out[kind] = {part: {name: _median([m[part][name] for m in mine])
                            for name in mine[0][part]} for part in mine[0]}
    return out


def main(calls: int = 900, seq: int = 300, rounds: int = 2, delay: float = 0.5,
         server: str | None = None) -> dict[str, Any]:
    """Run both clients ``rounds`` times, alternating; print and return the figures.

    ``server`` (the database, for ``bench.run_all``) is not used: no database here.
    """
    raise_open_files_limit()
    results: list[dict[str, Any]] = []
    with model_server(delay) as slow_url, model_server(0.0) as fast_url:
        for i in range(rounds):
            order = CLIENTS if i % 2 == 0 else CLIENTS[::-1]
            results.append({kind: asyncio.run(one_round(kind, slow_url, fast_url, calls, seq))
                            for kind in order})
    medians = summary(results)
    figures: dict[str, Any] = {
        "transport_calls": calls, "transport_server_delay_s": delay,
        "transport_sequential_calls": seq, "transport_rounds": rounds,
        "transport_medians": medians, "transport_by_round": results,
    }
    for kind in CLIENTS:
        m = medians[kind]
        figures[f"transport_{kind}_burst_cpu_ms_per_call"] = \
            m["burst_new_connections"]["cpu_ms_per_call"]
        figures[f"transport_{kind}_warm_burst_cpu_ms_per_call"] = \
            m["burst_kept_alive"]["cpu_ms_per_call"]
        figures[f"transport_{kind}_sequential_p50_ms"] = m["sequential"]["p50_ms"]
        figures[f"transport_{kind}_sequential_p99_ms"] = m["sequential"]["p99_ms"]
    print(json.dumps(figures), flush=True)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=900)
    parser.add_argument("--sequential", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.5)
    a = parser.parse_args()
    main(a.calls, a.sequential, a.rounds, a.delay)
