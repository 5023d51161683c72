"""A call ridden out through a failover: backoff, and a deadline."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from runtime.store.postgres.failover import OUTAGE, is_failover_error

T = TypeVar("T")


def backoff_delays(first: float = 0.1, cap: float = 2.0) -> Callable[[], float]:
    """A generator of delays: doubling from ``first`` up to ``cap``, with jitter."""
    state = {"next": first}

    def delay() -> float:
        value = state["next"]
        state["next"] = min(cap, value * 2)
        return value * (0.5 + random.random() / 2)

    return delay


def retry(fn: Callable[[], T], timeout: float, on_retry: Callable[[BaseException], None]
          | None = None) -> T:
    """Call ``fn``; on a failover error, back off and call it again, up to ``timeout`` s.

    ``fn`` must be safe to call again after an in-doubt COMMIT (guarded, or keyed by an
    idempotency key). The last error is raised when the time is up; any other error at
    once.
    """
    deadline = time.monotonic() + timeout
    delay = backoff_delays()
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_failover_error(exc) or time.monotonic() >= deadline:
                raise
            OUTAGE.begin(exc)
            if on_retry is not None:
                on_retry(exc)
            time.sleep(max(0.0, min(delay(), deadline - time.monotonic())))
