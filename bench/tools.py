"""What a tool round costs, and what a crash costs a tool-calling agent.

1. ``tool_round_overhead_ms``: one task calls the model with a no-op ``async`` tool that
   the loopback Ollama-compatible server (answering at once) calls ``rounds`` times, one
   call per reply: ``rounds + 1`` model calls and ``rounds`` durable steps. The same task
   then makes ``rounds + 1`` plain model calls. The overhead of a tool round is the loop's
   time minus the time spent in its model calls (timed around each), divided by
   ``rounds``: the step's begin (a fenced write on the loop's own async connection,
   awaited before the tool runs), the tool call, the growing conversation; the step's
   finish (fenced, durable) is written while the next model call runs and awaited after
   it, so its round trip overlaps that call. p50 (and p90) over ``samples`` tasks; goal
   <= 2 ms. Also given: the loop against the plain calls timed apart (noisier: two runs
   of six model calls; it counts whatever the overlapped finish adds to a model call).
   Charges are written one transaction per call (no batch writer), in both measurements.
   The loopback server sets TCP_NODELAY (without it every answer waited ~40 ms for a
   delayed ACK, which drowned the figure in noise).
2. ``steps_under_crash``: runs the chaos test ``tests/chaos/test_steps_under_crash.py``
   (four tasks of six tool calls, real worker processes, one SIGKILLed every 1.5 s) and
   reports the counts it prints (``--crash`` to include it; it takes about a minute).

    python -m bench.tools [--samples 200] [--rounds 5] [--crash]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from agents.tools import Tool
from bench.common import ms, open_store, percentile, report, scratch_database
from runtime.config import Settings
from runtime.engine.store_ledger import StoreLedger
from runtime.llm.backends.ollama import OllamaBackend
from runtime.llm.handle import LLMFactory
from runtime.store.rows import NewTask
from runtime.store.store import Store
from tests.fake_ollama import FakeOllama, calls_until

REPO = Path(__file__).resolve().parents[1]
CRASH_TEST = "tests/chaos/test_steps_under_crash.py"


class NoArgs(BaseModel):
    """A no-op tool's arguments."""

    n: int = 0


async def noop(n: int = 0) -> int:
    """The no-op tool."""
    return n


def _one_sample(store: Store, factory: LLMFactory, rounds: int,
                i: int) -> tuple[float, float, float]:
    """(loop seconds, seconds of the loop's model calls, seconds of as many plain calls)."""
    store.tasks.submit(NewTask(to_agent="bench_tools", type="task", payload={"goal": f"b{i}"},
                               budget_tokens=10_000_000))
    (row,) = store.claims.claim(["bench_tools"], 1, "bench", 300)
    llm = factory.for_task(row, row["lease_token"], threading.Event())
    tool = Tool("noop", "Does nothing.", NoArgs, noop)
    in_model = [0.0]
    call = llm._call

    async def timed_call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await call(*args, **kwargs)
        finally:
            in_model[0] += time.perf_counter() - started

    async def loop() -> float:
        llm._call = timed_call  # type: ignore[method-assign]
        started = time.perf_counter()
        try:
            reply = await llm.acomplete(f"sample {i}: call the tool", tools=[tool],
                                        max_tool_rounds=rounds, max_tokens=16)
        finally:
            llm._call = call  # type: ignore[method-assign]
        assert reply.tool_rounds == rounds, reply.tool_rounds
        return time.perf_counter() - started

    async def plain() -> float:
        started = time.perf_counter()
        for k in range(rounds + 1):
            await llm.acomplete(f"sample {i}: plain call {k}", max_tokens=16)
        return time.perf_counter() - started

    looped = factory.calls.run(loop())
    return looped, in_model[0], factory.calls.run(plain())


def tool_round_overhead(store: Store, samples: int, rounds: int) -> dict[str, Any]:
    """p50/p90 ms of one tool round beyond its model calls."""
    fake = FakeOllama().start()
    fake.tool_plan = calls_until(rounds, "noop")
    factory = LLMFactory(Settings(), StoreLedger(store),
                         backend=OllamaBackend(fake.url, 30.0), announcement="bench")
    try:
        for i in range(5):  # warm up connections, caches and the plans of the statements
            _one_sample(store, factory, rounds, -1 - i)
        pairs = [_one_sample(store, factory, rounds, i) for i in range(samples)]
    finally:
        factory.close()
        fake.stop()
    # Beyond the model calls as timed inside the loop (their own variance left out) ...
    overheads = [(loop - model) / rounds for loop, model, _ in pairs]
    # ... and beyond as many plain calls of the same task, timed apart (noisier).
    versus_plain = [(loop - plain) / rounds for loop, _, plain in pairs]
    return {
        "samples": samples, "rounds_per_sample": rounds,
        "tool_round_overhead_ms_p50": ms(percentile(overheads, 50)),
        "tool_round_overhead_ms_p90": ms(percentile(overheads, 90)),
        "tool_round_vs_plain_calls_ms_p50": ms(percentile(versus_plain, 50)),
        "loop_ms_p50": ms(percentile([p[0] for p in pairs], 50)),
        "model_call_ms_p50": ms(percentile([p[1] / (rounds + 1) for p in pairs], 50)),
        "plain_call_ms_p50": ms(percentile([p[2] / (rounds + 1) for p in pairs], 50)),
        "goal_tool_round_overhead_ms": 2.0,
    }


def steps_under_crash() -> dict[str, Any]:
    """Run the chaos test once and return the counts it printed."""
    proc = subprocess.run([sys.executable, "-m", "pytest", CRASH_TEST, "-q", "-s",
                           "-p", "no:cacheprovider"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("STEPS_UNDER_CRASH ")),
                None)
    if line is None:
        return {"steps_under_crash_error": proc.stdout[-2000:] + proc.stderr[-2000:]}
    figures = json.loads(line.split(" ", 1)[1])
    figures["test_passed"] = proc.returncode == 0
    return {f"steps_under_crash_{k}": v for k, v in figures.items()}


def main(samples: int = 200, rounds: int = 5, crash: bool = True,
         server: str | None = None) -> dict[str, Any]:
    """Run in a scratch database; print and return the figures."""
    with scratch_database("tools", server) as url:
        store = open_store(url)
        try:
            figures = tool_round_overhead(store, samples, rounds)
        finally:
            store.dispose()
    if crash:
        figures.update(steps_under_crash())
    result = report("tools", figures)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--crash", action="store_true", help="also run steps_under_crash")
    args = parser.parse_args()
    main(args.samples, args.rounds, args.crash)
