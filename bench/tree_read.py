"""Reading a 10,000-node tree with its totals, as ``orgchart tree`` and the API do.

A finished tree is written by hand (one statement): a root, ``fanout`` middle nodes,
and leaves under them up to ``nodes`` in all, each with a result, a verdict and some
spend. The figure is ``Store.tree_rows(root)`` + ``serialize.tree_json(rows)``, median
of ``repeats`` reads; the database part, the nesting part and ``json.dumps`` of the
result are printed beside it.

    python -m bench.tree_read [--nodes 10000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

from bench.common import connect, median, ms, open_store, report, scratch_database
from runtime.views import tree_json

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
       jsonb_build_object('goal', 'leaf ' || l), 'done', 2,
       jsonb_build_object('findings', jsonb_build_array('a finding', 'another finding'),
                          'confidence', 0.8),
       '{"pass": true}', 20, 0.0002, 0.25, 'leaf-' || l, now(), now()
FROM mids m, generate_series(1, %(leaves)s) AS l
"""


def build_tree(url: str, nodes: int) -> uuid.UUID:
    """Write one finished tree of exactly ``nodes`` nodes (root, middles, leaves)."""
    if nodes < 3:
        raise ValueError("a tree bench needs at least 3 nodes")
    mids = max(1, int((nodes - 1) ** 0.5))
    leaves, extra = divmod(nodes - 1 - mids, mids)
    root = uuid.uuid4()
    with connect(url) as conn:
        conn.execute(BUILD_TREE, {"root": root, "mids": mids, "leaves": leaves})
        if extra:  # top up under the root so the count is exact
            conn.execute(
                "INSERT INTO tasks (id, parent_id, root_id, to_agent, type, payload, status, "
                "depth, own_tokens, idempotency_key, completed_at) "
                "SELECT gen_random_uuid(), %(root)s, %(root)s, 'echo', 'task', '{}', 'done', 1, "
                "1, 'extra-' || i, now() FROM generate_series(1, %(n)s) AS i",
                {"root": root, "n": extra})
        conn.execute("VACUUM ANALYZE tasks")
    return root


def measure(url: str, nodes: int = 10_000, repeats: int = 7) -> dict[str, Any]:
    """Median read + nest time of a ``nodes``-node tree."""
    root = build_tree(url, nodes)
    store = open_store(url, pool_size=2)
    total, read, nest, dump = [], [], [], []
    try:
        store.tree_rows(root)  # warm the pool and the cache
        for _ in range(repeats):
            t0 = time.perf_counter()
            rows = store.tree_rows(root)
            t1 = time.perf_counter()
            tree = tree_json(rows)
            t2 = time.perf_counter()
            body = json.dumps(tree)
            t3 = time.perf_counter()
            read.append(t1 - t0)
            nest.append(t2 - t1)
            total.append(t2 - t0)
            dump.append(t3 - t2)
    finally:
        store.dispose()
    if tree is None or tree["totals"]["tasks"] != nodes:
        raise RuntimeError(f"the tree read back has {tree and tree['totals']['tasks']} nodes")
    return {
        "tree_ms_10k": ms(median(total)),
        "tree_read_rows_ms": ms(median(read)),
        "tree_nest_ms": ms(median(nest)),
        "tree_json_dumps_ms": ms(median(dump)),
        "tree_json_bytes": len(body),
        "tree_nodes": nodes,
        "tree_repeats": repeats,
    }


def main(nodes: int = 10_000, repeats: int = 7, server: str | None = None) -> dict[str, Any]:
    """Run in a scratch database; print and return the figures."""
    with scratch_database("tree", server) as url:
        figures = measure(url, nodes, repeats)
    return report(f"tree read ({nodes} nodes: tree_rows + tree_json)", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=7)
    a = parser.parse_args()
    main(a.nodes, a.repeats)
