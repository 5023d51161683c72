"""What the model layer's durability and limits cost, measured against a real PostgreSQL.

1. ``calls``: ``calls`` sequential ``complete()`` calls of one task on the offline backend
   (no network: what is left is the model layer and its database work: the record
   lookup, the queue depth, the charge), with ``[llm] durable`` on and off; then the same
   calls served from the record after a re-delivery (replayed, charged zero).
2. ``parallel``: ``parallel`` calls gathered in one task against the loopback
   Ollama-compatible server (``delay`` seconds per call), with ``[ollama] max_parallel``
   1 and 8: wall seconds and the most calls the server served at once.

    python -m bench.model_calls [--calls 200] [--parallel 16] [--delay 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any

import sqlalchemy as sa

from bench.common import median, ms, open_store, report, scratch_database
from runtime.config import Settings
from runtime.engine.store_ledger import StoreLedger
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.backends.ollama import OllamaBackend
from runtime.llm.handle import LLMFactory, TaskLLM
from runtime.store.rows import NewTask
from runtime.store.store import Store
from tests.fake_ollama import FakeOllama


def _claim(store: Store) -> dict[str, Any]:
    store.tasks.submit(NewTask(to_agent="bench_llm", type="task", payload={"goal": "bench"},
                               budget_tokens=10_000_000))
    (row,) = store.claims.claim(["bench_llm"], 1, "bench", 300)
    return row


def _llm(factory: LLMFactory, row: dict[str, Any]) -> TaskLLM:
    return factory.for_task(row, row["lease_token"], threading.Event())


def _timed(llm: TaskLLM, calls: int) -> list[float]:
    times = []
    for i in range(calls):
        started = time.perf_counter()
        llm.complete(f"bench call {i}: summarise the market", max_tokens=32)
        times.append(time.perf_counter() - started)
    return times


def sequential(store: Store, calls: int) -> dict[str, Any]:
    """ms per call with durable on, off, and served from the record."""
    figures: dict[str, Any] = {}
    for durable in (True, False):
        settings = Settings.model_validate({"llm": {"durable": durable}})
        factory = LLMFactory(settings, StoreLedger(store), backend=OfflineBackend(),
                             announcement="bench")
        try:
            row = _claim(store)
            times = _timed(_llm(factory, row), calls)
            figures[f"call_ms_durable_{'on' if durable else 'off'}"] = ms(median(times))
            if durable:  # a dead worker: the lease expires, the reaper frees the task
                with store.engine.begin() as conn:
                    conn.execute(sa.text("UPDATE tasks SET lease_expires_at = now() - "
                                         "interval '1 hour' WHERE id = :id"), {"id": row["id"]})
                store.hygiene.reap(max_delivery=100)
                (again,) = store.claims.claim(["bench_llm"], 1, "bench2", 300)
                replayed = _timed(_llm(factory, again), calls)
                figures["call_ms_replayed"] = ms(median(replayed))
        finally:
            factory.close()
    return figures


def parallel(store: Store, n: int, delay: float) -> dict[str, Any]:
    """Wall seconds for ``n`` gathered calls with max_parallel 1 and 8."""
    figures: dict[str, Any] = {}
    for limit in (1, 8):
        fake = FakeOllama().start()
        fake.delay_seconds = delay
        settings = Settings.model_validate({"ollama": {"max_parallel": limit}})
        factory = LLMFactory(settings, StoreLedger(store),
                             backend=OllamaBackend(fake.url, 30.0, max_parallel=limit),
                             announcement="bench")
        try:
            llm = _llm(factory, _claim(store))

            async def gather(llm: TaskLLM = llm) -> None:
                await asyncio.gather(*(llm.acomplete(f"part {i}", max_tokens=16)
                                       for i in range(n)))

            started = time.perf_counter()
            factory.calls.run(gather())
            figures[f"parallel_{n}_calls_s_max_parallel_{limit}"] = round(
                time.perf_counter() - started, 3)
            figures[f"parallel_server_max_in_flight_{limit}"] = fake.max_in_flight
        finally:
            factory.close()
            fake.stop()
    return figures


def main(calls: int = 200, n_parallel: int = 16, delay: float = 0.1,
         server: str | None = None) -> dict[str, Any]:
    """Run in a scratch database; print and return the figures."""
    with scratch_database("llm", server) as url:
        store = open_store(url)
        try:
            figures = {"calls": calls, **sequential(store, calls),
                       **parallel(store, n_parallel, delay)}
        finally:
            store.dispose()
    return report("model_calls", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--delay", type=float, default=0.1)
    args = parser.parse_args()
    main(args.calls, args.parallel, args.delay)
