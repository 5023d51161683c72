"""Threads that run blocking calls for a loop, and results handed back in batches."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from runtime.engine.threads import LoopHandoff, ThreadRunner, handoff_for


def test_a_runner_returns_results_and_raises_errors_in_the_awaiting_coroutine() -> None:
    runner = ThreadRunner(4, "t")

    def fails() -> None:
        raise KeyError("nope")

    async def main() -> list[int]:
        with pytest.raises(KeyError, match="nope"):
            await runner.run(fails)
        return await asyncio.gather(*(runner.run(pow, i, 2) for i in range(200)))

    try:
        assert asyncio.run(main()) == [i * i for i in range(200)]
    finally:
        runner.shutdown()


def test_calls_run_in_the_runners_threads_at_most_threads_at_once() -> None:
    runner = ThreadRunner(3, "probe")
    lock, running, most, names = threading.Lock(), [0], [0], set()

    def probe() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            names.add(threading.current_thread().name)
        time.sleep(0.01)
        with lock:
            running[0] -= 1

    async def main() -> None:
        await asyncio.gather(*(runner.run(probe) for _ in range(30)))

    try:
        asyncio.run(main())
    finally:
        runner.shutdown()
    assert most[0] == 3 and names == {"probe_0", "probe_1", "probe_2"}


def test_many_results_from_threads_wake_the_loop_once_per_batch() -> None:
    class CountingLoop(asyncio.SelectorEventLoop):
        wakeups = 0

        def call_soon_threadsafe(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            CountingLoop.wakeups += 1
            return super().call_soon_threadsafe(*args, **kwargs)

    loop = CountingLoop()
    try:
        futures = [loop.create_future() for _ in range(500)]
        handoff = LoopHandoff(loop)

        def settle_all() -> None:  # a thread hands back 500 results in a burst
            for i, future in enumerate(futures):
                handoff.settle(future, i)

        thread = threading.Thread(target=settle_all)
        thread.start()
        thread.join()
        assert loop.run_until_complete(asyncio.gather(*futures)) == list(range(500))
        assert CountingLoop.wakeups == 1  # the loop did not run between them: one wake-up
    finally:
        loop.close()


def test_a_cancelled_wait_is_left_alone_and_a_closed_loop_is_ignored() -> None:
    loop = asyncio.new_event_loop()
    handoff = handoff_for(loop)
    assert handoff_for(loop) is handoff
    cancelled, error = loop.create_future(), loop.create_future()
    cancelled.cancel()
    handoff.settle(cancelled, 1)
    handoff.settle(error, error=ValueError("bad"))
    loop.run_until_complete(asyncio.sleep(0))
    assert cancelled.cancelled()
    assert isinstance(error.exception(), ValueError)
    loop.close()
    handoff.settle(loop.create_future(), 2)  # nothing to wake: dropped without an error


def test_shutdown_can_drop_the_calls_still_queued() -> None:
    runner = ThreadRunner(1, "slow")
    gate, ran = threading.Event(), []

    def step(i: int) -> None:
        gate.wait(5)
        ran.append(i)

    async def main() -> None:
        jobs = [asyncio.ensure_future(runner.run(step, i)) for i in range(5)]
        await asyncio.sleep(0.05)  # the first call is running, four are queued
        runner.shutdown(wait=False, cancel_pending=True)
        gate.set()
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)

    asyncio.run(main())
    for thread in [t for t in threading.enumerate() if t.name.startswith("slow_")]:
        thread.join(5)  # the runner's threads are named after it
    assert ran == [0]
