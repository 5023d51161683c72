"""``bench.peers`` runs small: each installed runtime makes the tree's calls, and the chain's.

A tiny tree (1 -> 2 -> 3) and a 3-level chain against a 0.01 s model. The peers are also
SIGKILLed half way and resumed (orgchart's resumption waits for its 30 s leases: left to
the bench). No timing is asserted.
"""

from __future__ import annotations

import pytest

from bench.peers.harness import RUNTIMES, Runtime, installed, measure
from bench.peers.shape import Shape

TREE = Shape("tree", leads=2, writers=3)
CHAIN = Shape("chain", depth=3)
MEASURED = [rt for rt in RUNTIMES if rt.label != "langgraph_sync"]


@pytest.mark.parametrize("rt", MEASURED, ids=[rt.label for rt in MEASURED])
def test_each_runtime_makes_the_trees_calls_once_and_the_chains(rt: Runtime,
                                                                 server_url: str) -> None:
    if not installed(rt.runtime):
        pytest.skip(f"{rt.runtime} is not installed (pip install -e '.[bench]')")
    crash = rt.runtime != "orgchart"
    figures = measure((rt,), TREE, 0.01, CHAIN, 0.01, server_url, crash=crash)[rt.label]
    for client in ("shared", "ollama"):
        assert figures[f"{client}_model_calls"] == TREE.calls
        assert figures[f"{client}_rows_per_call"] > 0
    assert figures["code_lines"] > 10
    assert figures["chain_makespan_seconds"] > 3 * 0.01
    if crash:
        assert figures["crash_model_calls"] >= TREE.calls
        assert figures["repaid_calls"] == figures["crash_model_calls"] - TREE.calls
        assert 0 <= figures["durable_at_kill"] <= TREE.leads * TREE.writers
