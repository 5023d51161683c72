"""``bench.audit`` runs small: the checker finds no violation in the history it builds."""

from __future__ import annotations

from bench import audit


def test_the_audit_bench_builds_a_legal_history_and_times_the_checker(server_url: str) -> None:
    figures = audit.main(events=1_000, children=4, repeats=1, server=server_url)
    assert figures["audit_violations"] == 0
    assert figures["audit_events"] == figures["audit_trees"] * (6 + 3 * 4)
    assert figures["audit_calls"] == figures["audit_tasks"] == figures["audit_trees"] * 5
    assert figures["checker_seconds_per_100k_events"] > 0
