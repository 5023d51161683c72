"""Helpers the integration tests share: step a worker until the queue is quiet, wait for a
condition with a deadline (never sleep and hope).

The fixtures that build what these drive (``make_runtime``, ``runtime``, ``client``) are in
``tests/conftest.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.engine.worker import Worker
    from runtime.wiring import Runtime

#: How often :func:`wait_until` asks again.
POLL_SECONDS = 0.02


def drain(runtime: Runtime, agents: Sequence[str] | None = None, rounds: int = 60) -> Worker:
    """Step one worker (no maintenance, no LISTEN) until it claims nothing and no parent is
    ready to aggregate, at most ``rounds`` times; return the worker (its ``stats``)."""
    worker = runtime.worker(list(agents) if agents else None, maintenance=False,
                            listen=False)
    for _ in range(rounds):
        if worker.run_once() == 0 and runtime.store.hygiene.sweep().ready == 0:
            break
    return worker


def wait_until(condition: Callable[[], Any], timeout: float = 15.0,
               what: str = "the condition", interval: float = POLL_SECONDS) -> Any:
    """Poll ``condition`` until it returns something truthy and return that.

    Raises:
        AssertionError: ``timeout`` seconds passed first (the message names ``what``).

    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(interval)
