"""The experiments benchmark runs end to end at a toy size (its figures, not their speed)."""

from __future__ import annotations

from bench import experiments


def test_experiments_bench(server_url: str) -> None:
    figures = experiments.main(cases=2, delay=0.01, server=server_url)
    assert figures["experiment_cases"] == 2
    assert figures["experiment_baseline_calls_at_server"] > 0
    # Replay is exact: the variant asked the server nothing the baseline had asked.
    assert figures["experiment_asked_again"] == 0
    assert figures["experiment_paid_fraction"] == figures["experiment_changed_fraction"]
    assert figures["experiment_replayed_calls"] == figures["experiment_calls_not_made"]
    assert figures["rescore_seconds"] >= 0
