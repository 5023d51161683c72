"""A Prometheus scrape of ``GET /metrics`` on a table of 1,000,000 finished tasks.

Written by hand with generate_series: ``finished`` done tasks (each with its final
``task_events`` row; a tenth with a model call), then a live queue (pending, running
leased by a few workers). The scrape is the HTTP request through the app (FastAPI's
test client, no network) with Prometheus's own Accept header. Between scrapes
``new_tasks`` tasks finish (their events and model calls are what a scrape adds up).
The figure ``scrape_ms_1m_finished`` is the median scrape.

    python -m bench.scrape [--finished 1000000] [--repeats 9] [--write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
import warnings
from typing import Any

from bench.common import RESULTS_DIR, connect, median, ms, open_store, report, scratch_database

ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
          "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")

FILL = """
INSERT INTO tasks (id, root_id, to_agent, type, payload, status, own_tokens, own_usd,
                   duration_seconds, created_at, started_at, completed_at, route, model)
SELECT id, id, 'agent_' || mod(i, 12), 'task', '{"goal": "bench"}', 'done', 100, 0.001, 0.5,
       now() - interval '2 days' + i * interval '100 ms',
       now() - interval '2 days' + i * interval '100 ms' + interval '1 s',
       now() - interval '2 days' + i * interval '100 ms' + interval '2 s', 'local', 'm'
FROM (SELECT gen_random_uuid() AS id, i FROM generate_series(%(first)s::int, %(last)s::int) AS i) s
"""
EVENTS = """
INSERT INTO task_events (task_id, from_status, to_status, at, worker)
SELECT id, 'judging', 'done', completed_at, 'w-' || (random() * 4)::int FROM tasks
WHERE status = 'done' AND created_at > %(since)s
"""
CALLS = """
INSERT INTO model_calls (task_id, attempt, call_index, backend, route, model, prompt,
                         prompt_tokens, completion_tokens, duration_seconds, cost_usd, error)
SELECT id, 1, 0, 'ollama', 'local', 'm', 'p', 100, 20, random() * 3, 0.001,
       CASE WHEN random() < 0.02 THEN 'invalid JSON' END
FROM tasks WHERE status = 'done' AND created_at > %(since)s AND random() < %(share)s
"""
LIVE = """
INSERT INTO tasks (root_id, to_agent, type, payload, status, lease_owner, lease_token,
                   lease_expires_at, claimed_at, started_at, delivery_count)
SELECT NULL, 'agent_' || mod(i, 12), 'task', '{}',
       CASE WHEN mod(i, 10) = 0 THEN 'running' ELSE 'pending' END,
       CASE WHEN mod(i, 10) = 0 THEN 'w-' || mod(i, 4) END,
       CASE WHEN mod(i, 10) = 0 THEN gen_random_uuid() END,
       CASE WHEN mod(i, 10) = 0 THEN now() + interval '1 minute' END,
       CASE WHEN mod(i, 10) = 0 THEN now() END, CASE WHEN mod(i, 10) = 0 THEN now() END,
       CASE WHEN mod(i, 10) = 0 THEN 1 ELSE 0 END
FROM generate_series(1, %(n)s::int) AS i
"""


def fill(url: str, finished: int, live: int) -> None:
    """Write ``finished`` done tasks with their events and calls, and a live queue."""
    with connect(url) as conn:
        chunk = 250_000
        for first in range(1, finished + 1, chunk):
            last = min(finished, first + chunk - 1)
            conn.execute(FILL, {"first": first, "last": last})  # type: ignore[arg-type]
        conn.execute(EVENTS, {"since": "-infinity"})  # type: ignore[arg-type]
        conn.execute(CALLS, {"since": "-infinity", "share": 0.1})  # type: ignore[arg-type]
        conn.execute(LIVE, {"n": live})  # type: ignore[arg-type]
        conn.execute("VACUUM ANALYZE tasks")
        conn.execute("VACUUM ANALYZE task_events")
        conn.execute("VACUUM ANALYZE model_calls")


def measure(url: str, finished: int = 1_000_000, repeats: int = 9, live: int = 2_000,
            new_tasks: int = 2_000) -> dict[str, Any]:
    """Median scrape time with ``finished`` finished rows and ``new_tasks`` between scrapes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*httpx2")
        from fastapi.testclient import TestClient

    from runtime.http.api import create_app

    t0 = time.perf_counter()
    fill(url, finished, live)
    fill_s = time.perf_counter() - t0
    store = open_store(url, pool_size=2)
    times, sizes = [], []
    try:
        with TestClient(create_app(store=store)) as client:
            client.get("/metrics", headers={"Accept": ACCEPT})  # the cursors start here
            for r in range(repeats):
                with connect(url) as conn:
                    since = conn.execute("SELECT max(created_at) FROM tasks "
                                         "WHERE status = 'done'").fetchone()[0]  # type: ignore[index]
                    conn.execute(FILL, {"first": finished + 1 + r * new_tasks,  # type: ignore[arg-type]
                                        "last": finished + (r + 1) * new_tasks})
                    conn.execute(EVENTS, {"since": since})  # type: ignore[arg-type]
                    conn.execute(CALLS, {"since": since, "share": 1.0})  # type: ignore[arg-type]
                t1 = time.perf_counter()
                response = client.get("/metrics", headers={"Accept": ACCEPT})
                times.append(time.perf_counter() - t1)
                if response.status_code != 200 or not response.text.endswith("# EOF\n"):
                    raise RuntimeError(f"scrape failed: {response.status_code}")
                sizes.append(len(response.content))
            json_t0 = time.perf_counter()
            client.get("/metrics")
            json_s = time.perf_counter() - json_t0
    finally:
        store.dispose()
    return {
        "scrape_ms_1m_finished": ms(median(times)),
        "scrape_ms_max": ms(max(times)),
        "scrape_bytes": sizes[-1],
        "scrape_finished_rows": finished,
        "scrape_new_tasks_between": new_tasks,
        "scrape_repeats": repeats,
        "metrics_json_ms_1m_finished": ms(json_s),
        "scrape_fill_seconds": round(fill_s, 1),
    }


def main(finished: int = 1_000_000, repeats: int = 9, server: str | None = None,
         write: bool = False) -> dict[str, Any]:
    """Run in a scratch database; print and return the figures (merged into latest.json)."""
    with scratch_database("scrape", server) as url:
        figures = measure(url, finished, repeats)
    if write:
        path = RESULTS_DIR / "latest.json"
        latest = json.loads(path.read_text()) if path.exists() else {}
        latest.pop("tree_json_dumps_ms", None)  # the old path's, no longer measured
        latest.update(figures)
        latest["scrape_measured_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        latest["scrape_load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        path.write_text(json.dumps(latest, indent=2) + "\n")
    return report(f"Prometheus scrape ({finished} finished tasks)", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--write", action="store_true",
                        help="merge the figures into bench/results/latest.json")
    a = parser.parse_args()
    main(a.finished, a.repeats, write=a.write)
