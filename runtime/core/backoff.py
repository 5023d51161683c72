"""Exponential backoff: ``base * 2 ** attempt`` seconds, capped, with or without jitter.

Each caller keeps its own settings (its base, its cap, its jitter); the arithmetic is
here once. Jitter spreads retries of many callers that failed together:

- ``"none"``: the delay itself (the worker's database retries, a task's seed-001 retry);
- ``"full"``: uniform between 0 and the delay (a model call's retries);
- ``"equal"``: half the delay fixed, the other half random, so a retry never comes back
  at once (webhook deliveries, a call ridden out through a failover).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator
from typing import Literal

Jitter = Literal["none", "full", "equal"]
#: The exponent stops here: ``2.0 ** 1024`` overflows a float, and no cap is that far.
_MAX_EXPONENT = 1000


def delay(attempt: int, base: float, cap: float = math.inf, *, jitter: Jitter = "none",
          rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (0 for the first failure).

    Args:
        attempt: how many waits came before this one (0, 1, 2, ...).
        base: the first wait; it doubles per attempt.
        cap: the longest wait (before jitter).
        jitter: ``"none"``, ``"full"`` or ``"equal"`` (the module's docstring).
        rand: a number in [0, 1) (``random.random``; a test passes its own).

    """
    full = min(cap, base * 2.0 ** min(attempt, _MAX_EXPONENT))
    if jitter == "full":
        return rand() * full
    if jitter == "equal":
        return full / 2 + rand() * full / 2
    return full


def delays(base: float, cap: float = math.inf, *, jitter: Jitter = "none",
           rand: Callable[[], float] = random.random) -> Iterator[float]:
    """The endless waits of one streak of failures: :func:`delay` of 0, 1, 2, ...

    Start a new iterator when the streak ends (a success resets the backoff).
    """
    for attempt in itertools.count():
        yield delay(attempt, base, cap, jitter=jitter, rand=rand)
