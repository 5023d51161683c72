"""One peer runtime's work in a process of its own (started by :mod:`bench.peers.harness`).

    python -m bench.peers.child langgraph|dbos OPTION --db URL --model URL --client C
        --kind tree|chain [--leads N --writers N --depth N] [--resume]

Prints ``ready`` once the runtime is set up (its tables made, recovery started), waits for
a line on stdin, runs the work (or resumes it), then prints ``done`` and a JSON object: the
seconds from the go to the root's answer, this process's CPU seconds over them and its
peak RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from contextlib import AsyncExitStack

from bench.model_server import raise_open_files_limit
from bench.peers.shape import Shape, chat_client


async def main(args: argparse.Namespace) -> None:
    """Set up, wait for the go, run, report."""
    if args.runtime == "langgraph":
        from bench.peers.langgraph_tree import setup
    else:
        from bench.peers.dbos_tree import setup
    shape = Shape(args.kind, args.leads, args.writers, args.depth)
    async with AsyncExitStack() as stack:
        go = await setup(stack, args.db, chat_client(args.model, args.client), shape, args.option)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        cpu, started = time.process_time(), time.monotonic()
        await go(args.resume)
        seconds, cpu = time.monotonic() - started, time.process_time() - cpu
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print("done " + json.dumps({"seconds": seconds, "cpu_seconds": cpu,
                                    "peak_rss_kb": peak_kb}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runtime", choices=("langgraph", "dbos"))
    parser.add_argument("option")
    parser.add_argument("--db", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--client", choices=("ollama", "shared"), default="shared")
    parser.add_argument("--kind", choices=("tree", "chain"), default="tree")
    parser.add_argument("--leads", type=int, default=30)
    parser.add_argument("--writers", type=int, default=30)
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--resume", action="store_true")
    raise_open_files_limit()
    asyncio.run(main(parser.parse_args()))
