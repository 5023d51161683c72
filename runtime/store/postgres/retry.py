"""A call ridden out through a failover: backoff, and a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from runtime.core import backoff
from runtime.store.postgres.failover import OUTAGE, is_failover_error, sqlstate

T = TypeVar("T")


def backoff_delays(first: float = 0.1, cap: float = 2.0) -> Callable[[], float]:
    """The next delay at each call: doubling from ``first`` up to ``cap``, equal jitter."""
    return backoff.delays(first, cap, jitter="equal").__next__


def retry(fn: Callable[[], T], timeout: float, on_retry: Callable[[BaseException], None]
          | None = None, states: frozenset[str] = frozenset()) -> T:
    """Call ``fn``; on a failover error, back off and call it again, up to ``timeout`` s.

    ``fn`` must be safe to call again after an in-doubt COMMIT (guarded, or keyed by an
    idempotency key). ``states``: SQLSTATEs also written again (a deadlock the database
    broke, say), not counted as an outage. The last error is raised when the time is up;
    any other error at once.
    """
    deadline = time.monotonic() + timeout
    delay = backoff_delays()
    while True:
        try:
            return fn()
        except Exception as exc:
            outage = is_failover_error(exc)
            if not (outage or sqlstate(exc) in states) or time.monotonic() >= deadline:
                raise
            if outage:
                OUTAGE.begin(exc)
            if on_retry is not None:
                on_retry(exc)
            time.sleep(max(0.0, min(delay(), deadline - time.monotonic())))
