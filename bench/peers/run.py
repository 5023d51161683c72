"""Measure every installed runtime, print one table, return the figures (``bench.run_all``)."""

from __future__ import annotations

import json
import sys
from typing import Any

from bench.common import report
from bench.makespan import model_floor
from bench.peers.harness import RUNTIMES, goals, installed, measure, table
from bench.peers.shape import Shape


def main(leads: int = 30, writers: int = 30, delay: float = 1.0, depth: int = 50,
         chain_delay: float = 0.05, server: str | None = None, crash: bool = True,
         only: tuple[str, ...] = (), as_json: bool = False) -> dict[str, Any]:
    """Measure every installed runtime (or those in ``only``); print the table, return figures."""
    runtimes = tuple(rt for rt in RUNTIMES if (not only or rt.label in only)
                     and installed(rt.runtime))
    for rt in RUNTIMES:
        if not installed(rt.runtime):
            print(f"  {rt.label}: skipped, {rt.runtime} is not installed", file=sys.stderr)
    tree = Shape("tree", leads, writers, depth)
    runs = measure(runtimes, tree, delay, Shape("chain", leads, writers, depth), chain_delay,
                   server, crash)
    floor = (model_floor(leads * writers, delay, "bare")["seconds"]
             if any(rt.runtime == "orgchart" for rt in runtimes) else None)
    figures: dict[str, Any] = {"peers": runs, **goals(runs, floor),
                               "peers_tree_tasks": 1 + leads + leads * writers,
                               "peers_delay_seconds": delay, "peers_chain_depth": depth,
                               "peers_chain_delay_seconds": chain_delay}
    if as_json:
        print(json.dumps(figures))
        return figures
    print(table(runs), flush=True)
    return report("peers", figures)

