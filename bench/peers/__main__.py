"""``python -m bench.peers``: see :mod:`bench.peers` and :mod:`bench.peers.harness`."""

from __future__ import annotations

import argparse

from bench.peers.run import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--leads", type=int, default=30)
    parser.add_argument("--writers", type=int, default=30)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--chain-delay", type=float, default=0.05)
    parser.add_argument("--no-crash", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated runtime labels")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--server", default=None,
                        help="a PostgreSQL URL to make the scratch databases on (default: "
                             "a private embedded server)")
    a = parser.parse_args()
    main(a.leads, a.writers, a.delay, a.depth, a.chain_delay, server=a.server,
         crash=not a.no_crash, only=tuple(x for x in a.only.split(",") if x), as_json=a.json)
