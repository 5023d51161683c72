"""The statistics of an experiment's report: means with bootstrap intervals, paired tests.

Pure functions over lists of floats, no I/O. Every resampling takes a seed, so a report
read twice says the same thing.

- :func:`bootstrap_ci`: the percentile bootstrap interval of a mean (Efron's; 2,000
  resamples by default, as pydantic-evals and most eval tools report).
- :func:`paired_difference`: a variant against the baseline over the same cases: the mean
  of the per-case differences, its paired bootstrap interval, and the two-sided Wilcoxon
  signed-rank p-value (:func:`wilcoxon_signed_rank`).
- :func:`wilcoxon_signed_rank`: zero differences dropped (Wilcoxon's method), average
  ranks for ties; the exact null distribution when there are at most
  :data:`EXACT_WILCOXON_MAX_N` differences and no ties, else the normal approximation
  with the tie correction and no continuity correction (scipy.stats.wilcoxon's defaults,
  which the unit tests check it against).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

#: Resamples of the bootstrap.
BOOTSTRAP_RESAMPLES = 2000
#: The interval's level.
CONFIDENCE = 0.95
#: Up to this many non-zero differences without ties, the Wilcoxon p-value is exact.
EXACT_WILCOXON_MAX_N = 50


@dataclass(frozen=True)
class Interval:
    """A mean and its confidence interval (``None`` bounds when there is nothing to resample)."""

    mean: float | None
    low: float | None
    high: float | None
    n: int


@dataclass(frozen=True)
class PairedDifference:
    """A variant minus the baseline over the cases both have a value for."""

    diff: Interval
    p_value: float | None

    @property
    def excludes_zero(self) -> bool:
        """True when the interval lies wholly on one side of zero."""
        d = self.diff
        return d.low is not None and d.high is not None and (d.low > 0 or d.high < 0)


def mean(values: Sequence[float]) -> float | None:
    """The arithmetic mean, or None for no values."""
    return sum(values) / len(values) if values else None


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by linear interpolation (numpy's default method)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap_ci(values: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                 confidence: float = CONFIDENCE, seed: int = 0) -> Interval:
    """The mean of ``values`` with its percentile bootstrap interval."""
    n = len(values)
    if n == 0:
        return Interval(None, None, None, 0)
    m = sum(values) / n
    if n == 1 or min(values) == max(values):
        return Interval(m, m, m, n)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    tail = (1 - confidence) / 2
    return Interval(m, _percentile(means, tail), _percentile(means, 1 - tail), n)


def paired_difference(baseline: Sequence[float], variant: Sequence[float], *,
                      resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE,
                      seed: int = 0) -> PairedDifference:
    """``variant - baseline`` case by case: its mean, paired bootstrap interval, p-value."""
    if len(baseline) != len(variant):
        raise ValueError("paired values need the same cases on both sides")
    diffs = [v - b for b, v in zip(baseline, variant, strict=True)]
    interval = bootstrap_ci(diffs, resamples=resamples, confidence=confidence, seed=seed)
    return PairedDifference(interval, wilcoxon_signed_rank(diffs))


def _ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _exact_two_sided(n: int, w_plus: float) -> float:
    """P(W+ as extreme as observed) under the null, by counting subsets of ranks 1..n."""
    total = n * (n + 1) // 2
    counts = [1] + [0] * total  # counts[s]: subsets of {1..k} whose ranks sum to s
    for k in range(1, n + 1):
        for s in range(total, k - 1, -1):
            counts[s] += counts[s - k]
    stat = min(w_plus, total - w_plus)
    tail = sum(counts[: math.floor(stat) + 1])
    return min(1.0, 2 * tail / 2**n)


def wilcoxon_signed_rank(differences: Sequence[float]) -> float | None:
    """The two-sided p-value of the Wilcoxon signed-rank test, or None with no signal."""
    nonzero = [d for d in differences if d != 0]
    n = len(nonzero)
    if n == 0:
        return None
    ranks = _ranks([abs(d) for d in nonzero])
    w_plus = sum(r for r, d in zip(ranks, nonzero, strict=True) if d > 0)
    ties = len(set(ranks)) != n
    if n <= EXACT_WILCOXON_MAX_N and not ties:
        return _exact_two_sided(n, w_plus)
    expected = n * (n + 1) / 4
    variance = n * (n + 1) * (2 * n + 1) / 24
    groups: dict[float, int] = {}
    for r in ranks:
        groups[r] = groups.get(r, 0) + 1
    variance -= sum(t**3 - t for t in groups.values()) / 48
    if variance <= 0:
        return None
    z = (w_plus - expected) / math.sqrt(variance)
    return min(1.0, math.erfc(abs(z) / math.sqrt(2)))
