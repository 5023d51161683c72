"""Reading a 10,101-node tree with its totals, as ``orgchart tree`` and the API do.

A finished tree is written by hand (one statement): a root, ``fanout`` middle nodes,
and leaves under them up to ``nodes`` in all, each with a result, a verdict and some
spend. The figure ``tree_ms_10k`` is ``views.tree_text(store, root)``: the JSON text the
API sends, built in the database in one query and nested by splicing text (median of
``repeats`` reads); its query part and its nesting part are printed beside it, and the
old path (``store.reads.tree_rows`` + ``tree_json`` + ``json.dumps``) as ``tree_ms_python``.

Then the real-tree case (``tree_real_*``): the same shape with nodes of the size real
agents write (a payload of about 300 bytes with a goal, a result of about 700 bytes, a
verdict with reasons: about 1 KB of agent JSON per node), read in both shapes, by
``views.tree_text`` and by ``GET /trees/{id}`` (``?fields=summary`` and the full
default) from uvicorn on loopback, the whole body read by ``http.client``; and
``GET /tasks/{id}`` of one leaf (what the page asks when a node is opened).

First, ``tree_read_fresh_*``: the real tree read over HTTP right after it ends, before any
ANALYZE, in a database of its own (each task with two model calls and three transitions,
autovacuum off there so no analyze runs behind the read): PostgreSQL has no statistics
for any of its rows, as for a new tree in a big table (issue 44; on PostgreSQL 15 this read
took 3.5-5.3 s when the plan rested on statistics). ``tree_read_fresh_full_ms`` and
``tree_read_fresh_summary_ms`` are medians of ``repeats`` reads (``_first_ms``: the very
first read of each shape; ``tree_read_fresh_analyzed`` says whether anything analyzed it;
``_db_cpu_ms`` and ``_py_cpu_ms``: CPU per read of the database's server backends and of
this process, uvicorn and client, steadier than wall time on a shared machine),
then ``tree_read_analyzed_*_ms``: the same reads after ``ANALYZE``, to compare.

    python -m bench.tree_read [--nodes 10101] [--repeats 7] [--write] [--fresh-only]

``--write`` merges the figures into ``bench/results/latest.json`` (keeping the others), with
when and at which load average they were measured (``tree_read_fresh_measured_at`` and
``tree_read_fresh_load_average_at_end`` for a ``--fresh-only`` run, else ``tree_...``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from bench.common import (
    RESULTS_DIR,
    connect,
    median,
    ms,
    open_store,
    proc_cpu_seconds,
    report,
    scratch_database,
    server_cpu_seconds,
)
from runtime.views import assemble_tree, tree_json, tree_text

BUILD_TREE = """
WITH root AS (
    INSERT INTO tasks (id, root_id, to_agent, type, payload, status, depth, result, verdict,
                       own_tokens, own_usd, spent_tokens, spent_usd, duration_seconds,
                       started_at, completed_at)
    VALUES (%(root)s, %(root)s, 'ceo', 'goal', '{"goal": "tree bench"}', 'done', 0,
            '{"summary": "root"}', '{"pass": true}', 100, 0.001, 100, 0.001, 1.0, now(), now())
    RETURNING id
), mids AS (
    INSERT INTO tasks (id, parent_id, root_id, to_agent, type, payload, status, depth, result,
                       verdict, own_tokens, own_usd, duration_seconds, idempotency_key,
                       started_at, completed_at)
    SELECT gen_random_uuid(), r.id, r.id, 'intel_director', 'task',
           jsonb_build_object('goal', 'part ' || m), 'done', 1,
           jsonb_build_object('summary', 'middle ' || m), '{"pass": true}', 50, 0.0005, 0.5,
           'part-' || m, now(), now()
    FROM root r, generate_series(1, %(mids)s) AS m
    RETURNING id, root_id
)
INSERT INTO tasks (id, parent_id, root_id, to_agent, type, payload, status, depth, result,
                   verdict, own_tokens, own_usd, duration_seconds, idempotency_key,
                   started_at, completed_at)
SELECT gen_random_uuid(), m.id, m.root_id, 'competitor_scout', 'task',
       LEAF_PAYLOAD, 'done', 2, LEAF_RESULT, LEAF_VERDICT, 20, 0.0002, 0.25, 'leaf-' || l,
       now(), now()
FROM mids m, generate_series(1, %(leaves)s) AS l
"""


#: The leaves of the hand-written tree (``tree_ms_10k``): small, as SQL over ``l``.
SMALL_LEAF = {
    "payload": "jsonb_build_object('goal', 'leaf ' || l)",
    "result": "jsonb_build_object('findings', jsonb_build_array('a finding', "
              "'another finding'), 'confidence', 0.8)",
    "verdict": "'{\"pass\": true}'",
}
#: A real agent's leaf (bench/agents-like writers): the payload, result and verdict, as
#: SQL over ``l`` (the leaf's number) and ``m`` (its parent). About 1 KB a node.
REAL_LEAF = {
    "payload": "jsonb_build_object('goal', 'Write part ' || l || ' of the market report: "
               "pricing, competitors and the risks a buyer should weigh for durable agent "
               "runtimes', 'context', repeat('Notes the lead passed down to the writer. ', 4),"
               " 'section', l, 'style', 'plain English, short sentences, cite sources')",
    "result": "jsonb_build_object('summary', repeat('A finding about the market, with its "
              "source and the figure it rests on. ', 8), 'findings', jsonb_build_array("
              "'Vendor A prices per task', 'Vendor B bundles the queue', "
              "'Self-hosting wins above 1M tasks a month'), 'confidence', 0.8)",
    "verdict": "'{\"passed\": true, \"score\": 0.82, \"reasons\": [\"cites its "
               "sources\", \"answers the question asked\"]}'",
}


#: Model calls (``%(calls)s`` per task, the first offline) and the three transitions of
#: every task of tree ``%(root)s``, as a real tree leaves them.
CALLS_AND_EVENTS = """
WITH everyone AS (SELECT id FROM tasks WHERE root_id = %(root)s), calls AS (
    INSERT INTO model_calls (task_id, root_id, attempt, call_index, backend, route, model,
                             prompt, response, prompt_tokens, completion_tokens, cost_usd,
                             phase, position, request_hash)
    SELECT e.id, %(root)s, 1, i, CASE WHEN i = 1 THEN 'offline' ELSE 'ollama' END, 'fast',
           'm', 'a prompt', 'an answer', 30, 20, 0.0001, 'run', 'p' || i,
           md5(e.id::text || i)
    FROM everyone e, generate_series(1, %(calls)s) AS i
)
INSERT INTO task_events (task_id, from_status, to_status, worker)
SELECT e.id, s.f, s.t, 'bench'
FROM everyone e,
     (VALUES (NULL, 'pending', 1), ('pending', 'running', 2), ('running', 'done', 3))
         AS s(f, t, o)
ORDER BY e.id, s.o
"""


def build_tree(url: str, nodes: int, real: bool = False, calls: int = 0,
               analyze: bool = True) -> uuid.UUID:
    """Write one finished tree of exactly ``nodes`` nodes (root, middles, leaves).

    ``real`` gives the leaves the payload, result and verdict of :data:`REAL_LEAF`;
    ``calls`` gives every task that many model calls and its transitions
    (:data:`CALLS_AND_EVENTS`); ``analyze`` ends with ``VACUUM ANALYZE tasks``.
    """
    if nodes < 3:
        raise ValueError("a tree bench needs at least 3 nodes")
    mids = max(1, int((nodes - 1) ** 0.5))
    leaves, extra = divmod(nodes - 1 - mids, mids)
    root = uuid.uuid4()
    leaf = REAL_LEAF if real else SMALL_LEAF
    sql = (BUILD_TREE.replace("LEAF_PAYLOAD", leaf["payload"])
           .replace("LEAF_RESULT", leaf["result"]).replace("LEAF_VERDICT", leaf["verdict"]))
    with connect(url) as conn:
        conn.execute(sql, {"root": root, "mids": mids, "leaves": leaves})
        if extra:  # top up under the root so the count is exact
            conn.execute(
                "INSERT INTO tasks (id, parent_id, root_id, to_agent, type, payload, status, "
                "depth, own_tokens, idempotency_key, completed_at) "
                "SELECT gen_random_uuid(), %(root)s, %(root)s, 'echo', 'task', '{}', 'done', 1, "
                "1, 'extra-' || i, now() FROM generate_series(1, %(n)s) AS i",
                {"root": root, "n": extra})
        if calls:
            conn.execute(CALLS_AND_EVENTS, {"root": root, "calls": calls})
        if analyze:
            conn.execute("VACUUM ANALYZE tasks")
    return root


def measure(url: str, nodes: int = 10_101, repeats: int = 7) -> dict[str, Any]:
    """Median read time of a ``nodes``-node tree, as sent by the API and the old way."""
    root = build_tree(url, nodes)
    store = open_store(url, pool_size=2)
    total, query, nest, old = [], [], [], []
    try:
        tree_text(store, root)  # warm the pool and the cache
        for _ in range(repeats):
            t0 = time.perf_counter()
            text, _ = tree_text(store, root)
            total.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            rows = store.reads.tree_json_rows(root)
            t1 = time.perf_counter()
            assemble_tree(rows, root)
            t2 = time.perf_counter()
            query.append(t1 - t0)
            nest.append(t2 - t1)
        for _ in range(max(1, repeats // 3)):
            t0 = time.perf_counter()
            body = json.dumps(tree_json(store.reads.tree_rows(root)), default=str)
            old.append(time.perf_counter() - t0)
    finally:
        store.dispose()
    tree = json.loads(text)
    if tree["totals"]["tasks"] != nodes or json.loads(body) != tree:
        raise RuntimeError(f"the tree read back has {tree['totals']['tasks']} nodes "
                           "or differs from tree_json's")
    return {
        "tree_ms_10k": ms(median(total)),
        "tree_read_rows_ms": ms(median(query)),
        "tree_nest_ms": ms(median(nest)),
        "tree_ms_python": ms(median(old)),
        "tree_json_bytes": len(text.encode()),
        "tree_nodes": nodes,
        "tree_repeats": repeats,
    }


@contextlib.contextmanager
def serving(store: Any) -> Iterator[tuple[str, int]]:
    """The HTTP API on ``store`` in uvicorn, in a thread on a loopback port; (host, port)."""
    import uvicorn

    from runtime.http.api import create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(store=store, api_token=""),
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def http_get(address: tuple[str, int], path: str) -> tuple[float, int]:
    """Seconds to GET ``path`` and read its whole body (a fresh connection); its size."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(*address, timeout=60)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status} {body[:200]!r}")
    finally:
        conn.close()
    return time.perf_counter() - t0, len(body)


def measure_real(url: str, nodes: int = 10_101, repeats: int = 7) -> dict[str, Any]:
    """The real-tree case: both shapes by tree_text and over HTTP, and one node's detail."""
    root = build_tree(url, nodes, real=True)
    store = open_store(url, pool_size=4)
    figures: dict[str, Any] = {}
    try:
        leaf = store.reads.tree_json_rows(root, None, None)[-1][0]
        for fields in ("summary", "full"):
            tree_text(store, root, fields=fields)  # warm
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                text, _ = tree_text(store, root, fields=fields)
                times.append(time.perf_counter() - t0)
            figures[f"tree_real_{fields}_text_ms"] = ms(median(times))
            figures[f"tree_real_{fields}_bytes"] = len(text.encode())
        with serving(store) as address:
            for fields in ("summary", "full"):
                path = f"/trees/{root}?fields={fields}"
                http_get(address, path)  # warm
                cpu, db = time.process_time(), server_cpu_seconds(url)
                runs = [http_get(address, path)[0] for _ in range(repeats)]
                cpu, db_after = time.process_time() - cpu, server_cpu_seconds(url)
                figures[f"tree_real_{fields}_http_ms"] = ms(median(runs))
                figures[f"tree_real_{fields}_http_max_ms"] = ms(max(runs))
                # CPU per read, less sensitive to a loaded machine than the wall time:
                # this process (uvicorn and the client) and the PostgreSQL server.
                figures[f"tree_real_{fields}_http_cpu_ms"] = ms(cpu / repeats)
                if db is not None and db_after is not None:
                    figures[f"tree_real_{fields}_db_cpu_ms"] = ms((db_after - db) / repeats)
            http_get(address, f"/tasks/{leaf}")
            detail = [http_get(address, f"/tasks/{leaf}")[0] for _ in range(repeats)]
            figures["tree_real_node_detail_http_ms"] = ms(median(detail))
    finally:
        store.dispose()
    if json.loads(text)["totals"]["tasks"] != nodes:
        raise RuntimeError("the real tree read back has the wrong number of nodes")
    return {**figures, "tree_real_nodes": nodes}


def measure_fresh(url: str, nodes: int = 10_101, repeats: int = 7) -> dict[str, Any]:
    """The real tree read over HTTP just after it is written, with no ANALYZE of its rows."""
    with connect(url) as conn:
        for table in ("tasks", "model_calls", "task_events", "task_steps"):
            conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    root = build_tree(url, nodes, real=True, calls=2, analyze=False)
    store = open_store(url, pool_size=4)
    figures: dict[str, Any] = {}
    try:
        with serving(store) as address:
            for fields in ("full", "summary"):
                path = f"/trees/{root}?fields={fields}"
                first = http_get(address, path)[0]
                db, py = database_cpu_seconds(url), time.process_time()
                runs = [first] + [http_get(address, path)[0] for _ in range(repeats - 1)]
                db_after, py_after = database_cpu_seconds(url), time.process_time()
                figures[f"tree_read_fresh_{fields}_ms"] = ms(median(runs))
                figures[f"tree_read_fresh_{fields}_first_ms"] = ms(first)
                figures[f"tree_read_fresh_{fields}_max_ms"] = ms(max(runs))
                # CPU per read, steadier than the wall time on a shared machine: the
                # server backends of this database, and this process (uvicorn, client),
                # over the reads after the first (none when there is only the first).
                if repeats > 1 and db is not None and db_after is not None:
                    figures[f"tree_read_fresh_{fields}_db_cpu_ms"] = ms(
                        (db_after - db) / (repeats - 1))
                if repeats > 1:
                    figures[f"tree_read_fresh_{fields}_py_cpu_ms"] = ms(
                        (py_after - py) / (repeats - 1))
            figures["tree_read_fresh_analyzed"] = analyzed(url)
            with connect(url) as conn:  # the same reads once statistics exist, to compare
                conn.execute("ANALYZE tasks, model_calls, task_events, task_steps")
            for fields in ("full", "summary"):
                path = f"/trees/{root}?fields={fields}"
                runs = [http_get(address, path)[0] for _ in range(repeats)]
                figures[f"tree_read_analyzed_{fields}_ms"] = ms(median(runs))
    finally:
        store.dispose()
    return figures


def database_cpu_seconds(url: str) -> float | None:
    """CPU seconds used so far by the live server backends connected to ``url``'s database.

    Only this database's sessions (the bench's own scratch database), not the whole
    server's: other work on a shared server does not count. None for a remote server.
    """
    with connect(url) as conn:
        pids = [row[0] for row in conn.execute(
            "SELECT pid FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()")]
    if not pids or not os.path.exists(f"/proc/{pids[0]}"):
        return None
    return sum(proc_cpu_seconds(pid, with_children=False) for pid in pids)


def analyzed(url: str) -> bool:
    """Whether anything analyzed ``tasks`` or ``model_calls`` in this database yet."""
    with connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_user_tables WHERE relname IN ('tasks', 'model_calls') "
            "AND (last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL)").fetchone()
    return bool(row and row[0])


def main(nodes: int = 10_101, repeats: int = 7, server: str | None = None,
         write: bool = False, fresh_only: bool = False) -> dict[str, Any]:
    """Run in scratch databases; print and return the figures (merged into latest.json).

    ``fresh_only`` measures the ``tree_read_fresh_*`` figures alone.
    """
    with scratch_database("treefresh", server) as url:
        figures = measure_fresh(url, nodes, repeats)
    if not fresh_only:
        with scratch_database("tree", server) as url:
            figures.update(measure(url, nodes, repeats))
            figures.update(measure_real(url, nodes, repeats))
    if write:
        path = RESULTS_DIR / "latest.json"
        latest = json.loads(path.read_text()) if path.exists() else {}
        latest.pop("tree_json_dumps_ms", None)  # the old path's, no longer measured
        latest.update(figures)
        stamp = "tree_read_fresh" if fresh_only else "tree"  # the figures this run wrote
        latest[f"{stamp}_measured_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        latest[f"{stamp}_load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        path.write_text(json.dumps(latest, indent=2) + "\n")
    return report(f"tree read ({nodes} nodes: views.tree_text, JSON built in the database)",
                  figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_101)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--write", action="store_true",
                        help="merge the figures into bench/results/latest.json")
    parser.add_argument("--fresh-only", action="store_true",
                        help="only the read before any ANALYZE (tree_read_fresh_*)")
    a = parser.parse_args()
    main(a.nodes, a.repeats, write=a.write, fresh_only=a.fresh_only)
