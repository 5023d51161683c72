"""The statistics of experiment reports against references: scipy, and small hand cases."""

from __future__ import annotations

import random

import pytest

from runtime.experiments.scorers import contains
from runtime.experiments.stats import (
    bootstrap_ci,
    paired_difference,
    wilcoxon_signed_rank,
)

scipy_stats = pytest.importorskip("scipy.stats")


def test_the_exact_wilcoxon_p_value_of_a_hand_computed_case() -> None:
    # Differences 1..4, all positive: W+ = 10, W- = 0; of the 2^4 sign patterns only
    # "all +" and "all -" are as extreme, so p = 2/16.
    assert wilcoxon_signed_rank([1, 2, 3, 4]) == pytest.approx(2 / 16)
    # One negative of rank 1: W- = 1; patterns with W- <= 1 are {} and {1}: p = 2*2/16.
    assert wilcoxon_signed_rank([-1, 2, 3, 4]) == pytest.approx(4 / 16)


@pytest.mark.parametrize("n", [5, 9, 17, 30, 50])
def test_wilcoxon_matches_scipy_without_ties(n: int) -> None:
    rng = random.Random(n)
    diffs = [rng.gauss(0.3, 1.0) for _ in range(n)]
    assert wilcoxon_signed_rank(diffs) == pytest.approx(scipy_stats.wilcoxon(diffs).pvalue,
                                                        rel=1e-9)


@pytest.mark.parametrize("n", [60, 120])
def test_wilcoxon_matches_scipy_with_ties_and_zeros_on_many_cases(n: int) -> None:
    rng = random.Random(n)
    diffs = [round(rng.gauss(0.2, 1.0), 1) for _ in range(n)]
    ref = scipy_stats.wilcoxon(diffs, zero_method="wilcox", correction=False,
                               method="approx").pvalue
    assert wilcoxon_signed_rank(diffs) == pytest.approx(ref, rel=1e-9)


def test_no_difference_has_no_p_value() -> None:
    assert wilcoxon_signed_rank([0, 0, 0]) is None


def test_the_bootstrap_interval_matches_scipys_percentile_bootstrap() -> None:
    rng = random.Random(7)
    values = [rng.gauss(10, 2) for _ in range(40)]
    ours = bootstrap_ci(values, resamples=4000, seed=1)
    ref = scipy_stats.bootstrap((values,), lambda x, axis: x.mean(axis=axis),
                                n_resamples=4000, method="percentile",
                                random_state=1).confidence_interval
    assert ours.mean == pytest.approx(sum(values) / 40)
    # Different random draws: the bounds agree to within a small part of the spread.
    assert ours.low == pytest.approx(ref.low, abs=0.15)
    assert ours.high == pytest.approx(ref.high, abs=0.15)
    assert ours.low < ours.mean < ours.high


def test_intervals_of_constant_or_missing_values() -> None:
    assert bootstrap_ci([]).mean is None
    constant = bootstrap_ci([1.0, 1.0, 1.0])
    assert (constant.mean, constant.low, constant.high) == (1.0, 1.0, 1.0)


def test_a_paired_difference_that_clearly_moves_excludes_zero() -> None:
    base = [0.5, 0.6, 0.4, 0.55, 0.45, 0.5, 0.6, 0.5]
    better = [b + 0.1 * (i + 1) for i, b in enumerate(base)]  # distinct gains: no ties
    paired = paired_difference(base, better)
    assert paired.diff.mean == pytest.approx(0.45)
    assert paired.excludes_zero
    assert paired.p_value == pytest.approx(2 / 2**8)
    with pytest.raises(ValueError):
        paired_difference([1.0], [1.0, 2.0])


def test_json_subset_matching() -> None:
    answer = {"summary": "Yes", "items": [{"a": 1, "b": 2}, {"a": 3}], "n": 4}
    assert contains(answer, {"summary": "yes"})
    assert contains(answer, {"items": [{"a": 3}]})
    assert not contains(answer, {"items": [{"a": 5}]})
    assert not contains(answer, {"missing": 1})
    assert contains(4, 4) and not contains("4", 4)
