"""Charge latency: one model call's ``store.spend.charge``, 1,000 leaves of one tree in flight.

    python -m bench.charge [--leaves 1000] [--threads 64] [--charges 10000]

A root delegates ``leaves`` leaves and every leaf is claimed (running, leased), as a
worker holding a wide tree would. Then ``threads`` threads charge model calls to random
leaves (``charges`` in all) through the real ``store.spend.charge``: one guarded UPDATE of the
leaf plus its ``model_calls`` row. Before migration 0003 every charge also updated every
ancestor up to the root, so all of them queued on the root row.

Measured twice: ``direct`` (one ``store.spend.charge`` transaction per call, from the calling
thread) and ``batched`` (through :class:`runtime.engine.charges.ChargeWriter`: what
arrives within 2 ms is one ``store.spend.charge_many`` statement), the engine's path.

Figures: ``charge_p50_ms``, ``charge_p99_ms`` (batched; goal <= 20 ms),
``charges_per_second``, the same for ``direct_*``, and a check that the root row was not
touched by the charges (its spend stays 0 until the leaves end).

Those threads charge as fast as they can (a closed loop: the latency is their number over
the writer's throughput, and 64 Python threads fight the writer for the GIL). In a worker
every charge comes from its event loop (``ChargeWriter.acharge``; sync agents' calls run
on the loop too), one per model call as each call ends. ``loop`` measures that path: the
1,000 leaves are 1,000 coroutines on one loop, each making ``calls_per_leaf`` model calls
of 0.5 to 1.5 s (a sleep) and charging each as it ends: ``charge_loop_p50_ms``,
``charge_loop_p99_ms`` and ``charge_loop_per_second``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

from bench.common import ms, open_store, percentile, report, scratch_database
from runtime.engine.charges import ChargeWriter
from runtime.store.rows import ChildRow, ModelCharge, NewTask, TaskRow


def measure(leaves: int = 1000, threads: int = 64, charges: int = 10_000,
            batched: bool = True, server: str | None = None) -> dict[str, Any]:
    """Charge ``charges`` calls from ``threads`` threads; return the figures."""
    with scratch_database("charge", server) as url:
        store = open_store(url, pool_size=threads)
        try:
            root, held = _held_leaves(store, leaves)
            latencies: list[float] = []
            lock = threading.Lock()
            writer = ChargeWriter(store) if batched else None
            charge = writer.charge if writer is not None else store.spend.charge
            per_thread = charges // threads

            def charge_many(seed: int) -> None:
                rng = random.Random(seed)
                mine = []
                for n in range(per_thread):
                    leaf = rng.choice(held)
                    t0 = time.perf_counter()
                    charge(_call_charge(leaf, n))
                    mine.append(time.perf_counter() - t0)
                with lock:
                    latencies.extend(mine)

            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=threads) as pool:
                list(pool.map(charge_many, range(threads)))
            elapsed = time.perf_counter() - started
            if writer is not None:
                writer.close()
            root_row = store.reads.get(root["id"])
            live_tokens, _, live_calls = store.spend.live(root["id"])
        finally:
            store.dispose()
    return {
        "charge_path": "batched (ChargeWriter)" if batched else "direct (Store.charge)",
        "charge_leaves_in_flight": leaves,
        "charge_threads": threads,
        "charge_count": len(latencies),
        "charge_p50_ms": ms(percentile(latencies, 50)),
        "charge_p99_ms": ms(percentile(latencies, 99)),
        "charges_per_second": round(len(latencies) / elapsed),
        "charge_root_spent_tokens_while_running": int(root_row["spent_tokens"]),
        "charge_live_tree_spend_tokens": live_tokens,
        "charge_live_tree_calls": live_calls,
    }


def _held_leaves(store: Any, leaves: int) -> tuple[Any, list[TaskRow]]:
    """A root with ``leaves`` leaves, every leaf claimed (running, leased)."""
    root, _ = store.tasks.submit(NewTask(to_agent="planner", type="task",
                                         payload={"goal": "charge"},
                                         budget_tokens=10_000_000, budget_usd=Decimal(1000)))
    (parent,) = store.claims.claim(["planner"], 1, "bench-charge", 600)
    assert parent.lease_token is not None
    store.transitions.delegate(parent.id, parent.lease_token, [
        ChildRow("leaf", "task", {"goal": f"leaf {i}"}, f"leaf-{i}", 1000, 600,
                             Decimal("0.1")) for i in range(leaves)], "bench-charge")
    held: list[TaskRow] = []
    while len(held) < leaves:
        held += store.claims.claim(["leaf"], 1000, "bench-charge", 600)
    return root, held


def _call_charge(leaf: TaskRow, n: int) -> ModelCharge:
    assert leaf.lease_token is not None
    return ModelCharge(task_id=leaf.id, lease_token=leaf.lease_token, attempt=1,
                       call_index=n, backend="bench", route="local", route_reason="bench",
                       model="bench", prompt="p", response="r", prompt_tokens=10,
                       completion_tokens=5, duration_seconds=1.0,
                       cost_usd=Decimal("0.00015"))


def measure_loop(leaves: int = 1000, calls_per_leaf: int = 5,
                 server: str | None = None) -> dict[str, Any]:
    """The engine's path: ``leaves`` coroutines on one loop charge each call as it ends."""
    with scratch_database("charge", server) as url:
        store = open_store(url, pool_size=4)
        try:
            _, held = _held_leaves(store, leaves)
            writer = ChargeWriter(store)
            latencies: list[float] = []

            async def leaf_calls(leaf: TaskRow, seed: int) -> None:
                rng = random.Random(seed)
                for n in range(calls_per_leaf):
                    await asyncio.sleep(rng.uniform(0.5, 1.5))  # the model call
                    t0 = time.perf_counter()
                    if not await writer.acharge(_call_charge(leaf, n)):
                        raise RuntimeError("a charge was refused: the lease is held")
                    latencies.append(time.perf_counter() - t0)

            async def all_leaves() -> None:
                await asyncio.gather(*(leaf_calls(leaf, i) for i, leaf in enumerate(held)))

            started = time.perf_counter()
            asyncio.run(all_leaves())
            elapsed = time.perf_counter() - started
            writer.close()
        finally:
            store.dispose()
    return {"charge_loop_leaves": leaves, "charge_loop_count": len(latencies),
            "charge_loop_p50_ms": ms(percentile(latencies, 50)),
            "charge_loop_p99_ms": ms(percentile(latencies, 99)),
            "charge_loop_per_second": round(len(latencies) / elapsed)}


def main(leaves: int = 1000, threads: int = 64, charges: int = 10_000,
         server: str | None = None, calls_per_leaf: int = 5) -> dict[str, Any]:
    """Measure the three paths and print."""
    direct = measure(leaves, threads, charges, batched=False, server=server)
    figures = measure(leaves, threads, charges, batched=True, server=server)
    figures.update(measure_loop(leaves, calls_per_leaf, server=server))
    figures.update({f"charge_direct_{k.removeprefix('charge_')}": direct[k] for k in
                    ("charge_p50_ms", "charge_p99_ms", "charges_per_second")})
    return report("charge", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--leaves", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--charges", type=int, default=10_000)
    parser.add_argument("--calls-per-leaf", type=int, default=5)
    a = parser.parse_args()
    main(a.leaves, a.threads, a.charges, calls_per_leaf=a.calls_per_leaf)
