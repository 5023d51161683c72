"""``python -m bench.recorder_lag``: where a reply's time goes from the server to durable.

Runs the peers' tree (``bench.peers``' orgchart shape: 900 writers' answers leave the
server within about 0.2 s) once on one ``orgchart worker`` with the recorder process
tracing its charge batches (``RECORDER_TRACE_DIR``: a line per batch, with when each of
its replies was parsed, when the batch started, sent its COMMIT and ended). Prints, as
percentiles over the replies: the server's send to the recorder's parse (matched by
rank: both sorted), the parse to its batch's start (waiting for a lane), the batch's
statement, its COMMIT, and the whole lag from parse to durable; then the batches' sizes
and how many lanes overlapped. For measuring the recorder only (issue 44).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
import time
from typing import Any

from bench.common import scratch_database
from bench.makespan import _get, start_model_server
from bench.peers.harness import RUNTIMES, Process
from bench.peers.shape import Shape


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1) if values else 0.0


def _row(name: str, values: list[float]) -> str:
    return (f"  {name:<24} p50 {_pct(values, 0.5):7.1f}  p90 {_pct(values, 0.9):7.1f}  "
            f"max {_pct(values, 1.0):7.1f} ms  (n={len(values)})")


def measure(leads: int, writers: int, delay: float) -> dict[str, Any]:
    """One traced run; the lag's parts (see the module doc)."""
    trace = tempfile.mkdtemp(prefix="recorder-trace-")
    os.environ["RECORDER_TRACE_DIR"] = trace
    shape = Shape("tree", leads, writers, 50)
    with scratch_database("reclag") as url:
        model_proc, model_url = start_model_server(delay)
        proc = Process(RUNTIMES[0], url, model_url, "shared", shape)
        try:
            proc.wait_ready()
            _get(model_url + "/stats/reset")
            started = time.monotonic()
            proc.go()
            while not proc.finished(proc.root):
                time.sleep(0.02)
            makespan = time.monotonic() - started
            ends = sorted(_get(model_url + "/starts")["ends"])
            proc.stop()
        finally:
            if proc.proc.poll() is None:
                proc.kill(group=True)
            model_proc.kill()
            model_proc.wait()
    lines: list[dict[str, Any]] = []
    for path in glob.glob(f"{trace}/*.jsonl"):
        with open(path) as f:
            lines.extend(json.loads(line) for line in f)
    probes = [b for b in lines if b.get("probe")]
    lines = [b for b in lines if not b.get("probe")]
    batches = [b for b in lines if not b.get("journal")]
    journal = [b for b in lines if b.get("journal")]
    arrivals = sorted(a for b in batches for a in b["arr"] if a is not None)
    burst = ends[: leads * writers]  # the writers' answers (then the planner's)
    parsed = arrivals[: len(burst)]
    wait = [b["start"] - a for b in batches for a in b["arr"] if a is not None]
    stmt = [(b["commit"] or b["end"]) - b["start"] for b in batches for _ in b["arr"]]
    commit = [b["end"] - (b["commit"] or b["end"]) for b in batches for _ in b["arr"]]
    lag = [b["end"] - a for b in batches for a in b["arr"] if a is not None]
    print(f"makespan {makespan:.3f} s; {len(ends)} answers, the burst's first to last "
          f"{(burst[-1] - burst[0]) * 1000:.0f} ms; {len(batches)} batches")
    print(_row("server sent -> parsed", [p - e for p, e in zip(parsed, burst, strict=False)]))
    print(_row("parsed -> batch start", wait))
    print(_row("batch statement", stmt))
    print(_row("batch commit", commit))
    print(_row("parsed -> durable", lag))
    if journal:
        print(_row("parsed -> journaled", [b["end"] - a for b in journal for a in b["arr"]
                                           if a is not None]))
        print(_row("journal statement", [b["end"] - b["start"] for b in journal
                                         for _ in b["arr"]]))
        print(f"  journal batches: {len(journal)}")
    if probes and burst:
        during = [p for p in probes if burst[0] - 0.05 <= p["at"] <= burst[-1] + 0.3]
        print(f"  recorder loop woke >5 ms late {len(during)} times in the burst; "
              f"late sum {sum(p['late'] for p in during) * 1000:.0f} ms, its own CPU "
              f"in those waits {sum(p['cpu'] for p in during) * 1000:.0f} ms; worst "
              f"{max((p['late'] for p in during), default=0) * 1000:.0f} ms")
    sizes = [len(b["arr"]) for b in batches]
    print(f"  batch sizes: mean {statistics.mean(sizes):.1f}, max {max(sizes)}; "
          f"lanes {sorted({b['lane'] for b in batches})}")
    return {"makespan": makespan, "lag_p50_ms": _pct(lag, 0.5)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--leads", type=int, default=30)
    parser.add_argument("--writers", type=int, default=30)
    parser.add_argument("--delay", type=float, default=1.0)
    a = parser.parse_args()
    measure(a.leads, a.writers, a.delay)
