"""The one backoff: doubling from a base, capped, with none, full or equal jitter."""

from __future__ import annotations

import itertools
import math

from runtime.core.backoff import delay, delays


def test_doubling_from_the_base_up_to_the_cap() -> None:
    assert [delay(a, 0.1, 2.0) for a in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert [delay(a, 1.0) for a in range(4)] == [1.0, 2.0, 4.0, 8.0]  # no cap
    assert delay(5000, 1.0, 60) == 60  # no overflow however long the streak
    assert math.isfinite(delay(5000, 1.0))


def test_jitter() -> None:
    assert delay(3, 0.5, 30, jitter="full", rand=lambda: 0.0) == 0.0
    assert delay(3, 0.5, 30, jitter="full", rand=lambda: 0.5) == 2.0
    assert [delay(a, 1, 3600, jitter="equal", rand=lambda: 0.0) for a in (0, 1, 2)] == [
        0.5, 1, 2]
    assert [delay(a, 1, 3600, jitter="equal", rand=lambda: 1.0) for a in (0, 1, 2)] == [
        1, 2, 4]
    for attempt in range(10):
        assert 0 <= delay(attempt, 0.1, 2.0, jitter="full") <= 2.0
        assert 0.05 * 2 ** min(attempt, 4) <= delay(attempt, 0.1, 2.0, jitter="equal") <= 2.0


def test_delays_is_one_streak() -> None:
    assert list(itertools.islice(delays(0.1, 0.5), 5)) == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert next(delays(0.1, 0.5, jitter="equal", rand=lambda: 0.0)) == 0.05
