"""High availability: failover recovery and partition detection, from the ``ha`` tests.

    sudo .venv/bin/python -m bench.ha

Runs the ``tests/ha`` suite (a pg_auto_failover formation: a monitor and two PostgreSQL
15 nodes with synchronous replication; worker hosts in network namespaces) with
``ORGCHART_HA_FIGURES`` set, so that it writes what it measured to
``bench/results/ha-tests.json``, and prints those figures:

- ``ha_failover_recovery_seconds``: from SIGKILLing the primary (its ``pg_autoctl`` tree
  and postmaster) to the first task completed on the new primary, with 3 workers on the
  multi-host URL; ``ha_monitor_settings_ms`` are the monitor's health-check settings it
  ran with;
- ``ha_partition_detect_seconds``: from cutting a worker host off to that worker's "database
  connection lost" (within its ``tcp_user_timeout`` plus a heartbeat);
- ``ha_takeover_seconds``: from the cut to the last of its tasks claimed by another host;
- the counts: tasks, model calls paid twice (and the bound: calls in flight at the kill
  or the cut), late writes recorded (0: fencing refused them).

Needs root and the Debian packages ``postgresql-15-auto-failover`` and
``pg-auto-failover-cli``; elsewhere it reports ``ha_skipped`` with the reason. The
machine is shared: the seconds vary with its load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.ha_cluster import unavailable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "ha-tests.json"


def main(server: str | None = None, quick: bool = False) -> dict[str, Any]:
    """Run the ha suite (``server`` is unused: it makes its own formation) and print.

    ``quick`` (``run_all --quick``) skips it: it takes minutes, not a check.
    """
    why = "a quick run" if quick else unavailable()
    if why:
        figures: dict[str, Any] = {"ha_skipped": why}
    else:
        RESULTS.unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/ha"], cwd=REPO, check=False,
                              env={**os.environ, "ORGCHART_HA_FIGURES": str(RESULTS)})
        measured = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        figures = {"ha_tests_passed": done.returncode == 0,
                   "ha_monitor_settings_ms": measured.get("monitor_settings_ms")}
        for part in ("failover", "partition"):
            for key, value in (measured.get(part) or {}).items():
                name = key if key.startswith(("failover_", "partition_")) else f"{part}_{key}"
                figures[f"ha_{name}"] = value
    print(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
