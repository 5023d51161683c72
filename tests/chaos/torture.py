"""``make torture``: the chaos mix with the audit, for ``TORTURE_S`` seconds, random seeds.

Round after round until the time is up (default 600 s), it runs the chaos test
(``tests/chaos/test_chaos.py``: four workers, a SIGKILL a second, a server restart, two
cuts of every session) with a fresh seed, then one other fault test of the mix, each in a
``pytest`` process of its own on the embedded server (never set
``ORGCHART_TEST_DATABASE_URL``: the chaos test restarts its server). Every test ends with
the audit's checker (``assert_audited``), whose ``AUDIT_REPORT`` line this adds up.

A failing round prints its seed and the command that replays it; the run ends with
``history_checked_ops`` (events, calls, steps, operations and outside requests checked),
the violations found (goal 0), and the kills, restarts and partitions injected, and
writes them to ``bench/results/torture.json``. Exit status 1 if any round failed.

    TORTURE_S=600 python -m tests.chaos.torture
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "bench" / "results" / "torture.json"
CHAOS = "tests/chaos/test_chaos.py"
#: The rest of the mix: one of these after each chaos round.
MIX = (
    "tests/chaos/test_steering_chaos.py::test_a_cancel_racing_a_killed_worker_and_a_redelivery",
    "tests/chaos/test_durable_calls.py",
    "tests/chaos/test_steps_under_crash.py",
    "tests/chaos/test_tenant_limits.py::test_a_sigkilled_worker_never_leaves_the_tenants_count_high",
    "tests/chaos/test_answers_under_restart.py",
)
#: A round that outlives this is stopped and counted as failed.
ROUND_TIMEOUT_SECONDS = 600


def run_one(target: str, seed: int) -> tuple[bool, list[dict[str, Any]], str]:
    """Run one test target; return (passed, its audit reports, the tail of its output)."""
    env = {k: v for k, v in os.environ.items() if k != "ORGCHART_TEST_DATABASE_URL"}
    env["ORGCHART_CHAOS_SEED"] = str(seed)
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-s",
                               "-p", "no:cacheprovider", target], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=ROUND_TIMEOUT_SECONDS)
        out, ok = done.stdout + done.stderr, done.returncode == 0
    except subprocess.TimeoutExpired as exc:
        out, ok = f"timed out after {ROUND_TIMEOUT_SECONDS}s: {exc.stdout!r}"[-4000:], False
    reports = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
               if line.startswith("AUDIT_REPORT ")]
    return ok, reports, out[-3000:]


def main(seconds: float) -> int:
    """Run the mix for ``seconds``; print and save the figures; 1 if any round failed."""
    started = time.monotonic()
    rng = random.Random()
    checked: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    violations, rounds, failures = 0, 0, []
    while time.monotonic() - started < seconds:
        seed = rng.randrange(1 << 30)
        for target in (CHAOS, rng.choice(MIX)):
            if time.monotonic() - started >= seconds:
                break
            ok, reports, tail = run_one(target, seed)
            rounds += 1
            for r in reports:
                checked.update(r["checked"])
                faults.update(r["faults"])
                violations += r["violations"]
            status = "ok" if ok else "FAILED"
            print(f"[{time.monotonic() - started:6.0f}s] {status} {target} seed {seed}",
                  flush=True)
            if not ok:
                failures.append({"target": target, "seed": seed})
                print(f"  replay: ORGCHART_CHAOS_SEED={seed} .venv/bin/python -m pytest -s "
                      f"{target}\n{tail}", flush=True)
    ops = sum(n for k, n in checked.items() if k in ("events", "calls", "steps", "operations",
                                                     "outside requests"))
    figures = {"torture_seconds": round(time.monotonic() - started), "rounds": rounds,
               "history_checked_ops": ops, "checked": dict(checked), "violations": violations,
               "kills": faults.get("kill", 0), "restarts": faults.get("restart", 0),
               "partitions": faults.get("partition", 0), "failed_rounds": failures}
    print("TORTURE " + json.dumps(figures), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 1 if failures or violations else 0


if __name__ == "__main__":
    sys.exit(main(float(os.environ.get("TORTURE_S") or 600)))
