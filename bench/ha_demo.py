"""``make ha-demo``: a tree finishes on the new primary after the old one is killed.

    sudo .venv/bin/python -m bench.ha_demo [--leads 10] [--writers 20] [--workers 2]

Stands up a local pg_auto_failover formation (a monitor and two PostgreSQL 15 nodes on
loopback ports, synchronous replication, run as the ``postgres`` user; needs root and the
Debian packages ``postgresql-15-auto-failover`` and ``pg-auto-failover-cli``), starts
``orgchart worker`` processes on its multi-host URL, submits a tree of ``bench.agents``
(a planner, ``leads`` leads, ``writers`` writers each; the agents sleep instead of calling
a model, 3 s each), SIGKILLs the primary (its ``pg_autoctl`` tree and postmaster) while
the writers run, and prints the tree finishing on the new primary. Everything it started is
killed at the end, and its files removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from bench.ha_cluster import Formation, free_ports, unavailable
from runtime.store.postgres import engines, migrations
from runtime.store.store import Store

REPO = Path(__file__).resolve().parents[1]


def _count(store: Store, sql: str) -> int:
    try:
        with store.engine.connect() as conn:
            return int(conn.execute(sa.text(sql)).scalar() or 0)
    except sa.exc.DBAPIError:
        return -1  # the database is away: the failover is under way


def _workers(url: str, n: int, home: Path) -> list[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORGCHART_")}
    (home / "orgchart.toml").write_text("")
    env.update({"ORGCHART_DATABASE_URL": url, "ORGCHART_HOME": str(home),
                "ORGCHART_CONFIG": str(home / "orgchart.toml"),
                "ORGCHART_LLM__BACKEND": "offline", "PYTHONPATH": str(REPO)})
    log = open(home / "workers.log", "ab")  # noqa: SIM115 (kept open for the children)
    return [subprocess.Popen([sys.executable, "-m", "runtime.cli.app", "worker",
                              "--agents-module", "bench.agents"], env=env, cwd=REPO,
                             stdout=log, stderr=subprocess.STDOUT) for _ in range(n)]


def _submit(store: Store, leads: int, writers: int) -> str:
    from runtime.config import Settings
    from runtime.wiring import build_root, load_registry, submit_root

    settings = Settings()
    new = build_root(load_registry(settings, ["bench.agents"]), settings, goal="ha demo",
                     agent="mk_planner", budget_tokens=10_000_000, budget_usd="1000",
                     payload={"leads": leads, "writers": writers, "simulate": 3.0})
    return str(submit_root(store, new, "demo", timeout=60)[0]["id"])


def demo(leads: int, writers: int, workers: int) -> int:
    """Run the demo; 0 when the tree finished with every task done once."""
    why = unavailable()
    if why:
        print(f"ha-demo cannot run here: {why}")
        return 2
    home = Path(tempfile.mkdtemp(prefix="orgchart-ha-demo-"))
    monitor, node1, node2 = free_ports(3)
    formation = Formation(Path(f"/tmp/orgchart-ha-demo-{os.getpid()}"), monitor_port=monitor,
                          node_ports=(node1, node2))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        print("starting a monitor and two nodes (pg_autoctl, synchronous replication)...")
        t0 = time.monotonic()
        formation.start()
        url = formation.url()
        print(f"formed in {time.monotonic() - t0:.0f}s\n{formation.state_text()}\nURL: {url}")
        migrations.upgrade(url)
        store = Store(engines.create_db_engine(url, pool_size=2))
        root = _submit(store, leads, writers)
        total = 1 + leads + leads * writers
        procs = _workers(url, workers, home)
        print(f"root {root}: {total} tasks, {workers} workers")
        killed_at = None
        while True:
            done = _count(store, "SELECT count(*) FROM tasks WHERE status = 'done'")
            root_done = _count(store, f"SELECT count(*) FROM tasks WHERE id = '{root}' "
                                      "AND status = 'done'")
            print(f"  {time.strftime('%H:%M:%S')} done {done if done >= 0 else '?'}/{total}"
                  + ("" if done >= 0 else "  (database away: failing over)"), flush=True)
            if root_done == 1:
                break
            running = _count(store, "SELECT count(*) FROM tasks WHERE status = 'running'")
            if killed_at is None and running >= leads:  # writers in flight
                port = formation.primary_port()
                _, killed_at = formation.kill_primary()
                print(f"SIGKILLed the primary (127.0.0.1:{port}: pg_autoctl and postmaster)")
                new = formation.wait_failover(port)
                print(f"new primary 127.0.0.1:{new} after {time.time() - killed_at:.1f}s")
            time.sleep(0.5)
        once = _count(store, "SELECT count(*) FROM (SELECT task_id FROM task_events WHERE "
                             "to_status IN ('done','failed','escalated') GROUP BY task_id "
                             "HAVING count(*) <> 1) x")
        print(f"the tree finished on 127.0.0.1:{formation.primary_port()}: {total} tasks done,"
              f" {once} with other than one terminal event")
        store.dispose()
        return 0 if once == 0 else 1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        formation.close()
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leads", type=int, default=10)
    parser.add_argument("--writers", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    raise SystemExit(demo(args.leads, args.writers, args.workers))


if __name__ == "__main__":
    main()
