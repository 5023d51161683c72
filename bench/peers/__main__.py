"""``python -m bench.peers``: see :mod:`bench.peers` and :mod:`bench.peers.harness`."""

from __future__ import annotations

import argparse
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--leads", type=int, default=30)
    parser.add_argument("--writers", type=int, default=30)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--chain-delay", type=float, default=0.05)
    parser.add_argument("--no-crash", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated runtime labels")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    main(a.leads, a.writers, a.delay, a.depth, a.chain_delay, crash=not a.no_crash,
         only=tuple(x for x in a.only.split(",") if x), as_json=a.json)
