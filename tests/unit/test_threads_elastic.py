"""An elastic ThreadRunner: threads parked on a model call are replaced, then retire."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from runtime.engine.threads import ThreadRunner
from runtime.llm.loop import CallLoop


def _until(check: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    """Wait for ``check`` (a condition, not a timing: the test fails only if it never holds)."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def _parked_jobs(runner: ThreadRunner, calls: CallLoop, jobs: int,
                 release: threading.Event, check: Callable[[], None]) -> list[int]:
    """Run ``jobs`` blocking model-like calls in ``runner``; ``check`` while they wait."""

    async def reply(i: int) -> int:
        while not release.is_set():
            await asyncio.sleep(0.005)
        return i

    async def main() -> list[int]:
        pending = asyncio.gather(*(runner.run(calls.run, reply(i)) for i in range(jobs)))
        await asyncio.to_thread(check)
        release.set()
        return list(await pending)

    return asyncio.run(main())


def test_a_parked_thread_is_replaced_so_every_call_is_in_flight_at_once() -> None:
    runner, calls, release = ThreadRunner(2, "el", max_threads=50), CallLoop(), threading.Event()

    def check() -> None:
        _until(lambda: runner.parked == 12, "12 calls parked at once")
        assert runner.size == 14  # 12 parked, 2 free to run Python

    try:
        assert _parked_jobs(runner, calls, 12, release, check) == list(range(12))
        _until(lambda: runner.size == 2, "the extra threads retired")
        assert runner.parked == 0 and runner.peak_threads == 14
    finally:
        runner.shutdown()
        calls.close()


def test_the_pool_never_grows_past_max_threads() -> None:
    runner, calls, release = ThreadRunner(2, "cap", max_threads=4), CallLoop(), threading.Event()

    def check() -> None:
        _until(lambda: runner.parked == 4, "4 calls parked")
        time.sleep(0.05)  # give a wrong pool the chance to start a fifth thread
        assert runner.size == 4 and runner.parked == 4

    try:
        assert _parked_jobs(runner, calls, 6, release, check) == list(range(6))
        assert runner.peak_threads == 4
    finally:
        runner.shutdown()
        calls.close()


def test_a_fixed_pool_does_not_grow_and_its_threads_install_no_hooks() -> None:
    runner, calls, release = ThreadRunner(2, "fixed"), CallLoop(), threading.Event()

    def check() -> None:
        time.sleep(0.05)
        assert runner.size == 2 and runner.parked == 0

    try:
        assert _parked_jobs(runner, calls, 5, release, check) == list(range(5))
    finally:
        runner.shutdown()
        calls.close()


def test_shutdown_waits_for_every_thread_parked_ones_included() -> None:
    on_park: list[str] = []
    runner = ThreadRunner(1, "down", max_threads=8,
                          on_park=lambda: on_park.append(threading.current_thread().name))
    calls, release = CallLoop(), threading.Event()

    def check() -> None:
        _until(lambda: runner.parked == 3, "3 calls parked")

    try:
        assert _parked_jobs(runner, calls, 3, release, check) == [0, 1, 2]
        assert len(on_park) == 3
    finally:
        runner.shutdown(wait=True)
        calls.close()
    assert runner.size == 0
