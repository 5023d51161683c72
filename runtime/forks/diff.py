"""Compare two trees task by task: ``orgchart diff A B``, ``GET /diff/{a}/{b}`` and its page.

Tasks are paired by their *path*: the child keys from the root down (the root's path is
``/``), which is how a fork's branch finds its counterparts. Per pair: status, result (a
text diff of the JSON), verdict; own tokens, cost and duration with their deltas (B minus
A); model calls paid for and served from the record; and whether the agent's version or
a prompt's hash differs (what a re-run changed).
"""

from __future__ import annotations

import difflib
import json
import uuid
from decimal import Decimal
from typing import Any

from runtime.errors import BadInput
from runtime.store.queries import Task
from runtime.store.store import Store
from runtime.views import money, task_json

#: The task fields each side of a pair shows.
SIDE_FIELDS = ("id", "agent", "status", "result", "verdict", "error", "own_tokens", "own_usd",
               "duration_seconds", "agent_version", "prompt_hashes", "forked_from")


def _paths(rows: list[Task]) -> dict[str, Task]:
    """Path of child keys -> row, for one tree's rows (parents before children)."""
    by_id = {r["id"]: r for r in rows}
    memo: dict[uuid.UUID, str] = {}

    def path(row: Task) -> str:
        known = memo.get(row["id"])
        if known is not None:
            return known
        parent = by_id.get(row["parent_id"]) if row["parent_id"] else None
        if parent is None:
            found = "/"
        else:
            base = path(parent)
            found = f"{base.rstrip('/')}/{row.get('idempotency_key') or row['id']}"
        memo[row["id"]] = found
        return found

    return {path(r): r for r in rows}


def _side(row: Task | None, calls: dict[uuid.UUID, tuple[int, int]]) -> dict[str, Any] | None:
    if row is None:
        return None
    shaped = task_json(row)
    side = {k: shaped.get(k) for k in SIDE_FIELDS}
    paid, replayed = calls.get(row["id"], (0, 0))
    side.update(calls_paid=paid, calls_replayed=replayed)
    return side


def _result_text(side: dict[str, Any] | None) -> list[str]:
    if side is None or side.get("result") is None:
        return []
    return json.dumps(side["result"], indent=2, sort_keys=True, default=str).splitlines()


def _pair(path: str, a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any]:
    result_diff = list(difflib.unified_diff(_result_text(a), _result_text(b), "A", "B",
                                            lineterm="", n=2))
    pair: dict[str, Any] = {"path": path, "a": a, "b": b, "result_diff": result_diff,
                            "only_in": "a" if b is None else "b" if a is None else None}
    if a is not None and b is not None:
        pair["delta"] = {
            "own_tokens": int(b["own_tokens"]) - int(a["own_tokens"]),
            "own_usd": money(Decimal(b["own_usd"]) - Decimal(a["own_usd"])),
            "duration_seconds": round(float(b["duration_seconds"])
                                      - float(a["duration_seconds"]), 6),
        }
        pair["changed"] = {
            "status": a["status"] != b["status"],
            "result": bool(result_diff),
            "verdict": a["verdict"] != b["verdict"],
            "version": a["agent_version"] != b["agent_version"],
            "prompts": (a["prompt_hashes"] or {}) != (b["prompt_hashes"] or {}),
        }
    return pair


def _totals(sides: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tasks": len(sides),
        "own_tokens": sum(int(s["own_tokens"]) for s in sides),
        "own_usd": money(sum((Decimal(s["own_usd"]) for s in sides), Decimal(0))),
        "calls_paid": sum(s["calls_paid"] for s in sides),
        "calls_replayed": sum(s["calls_replayed"] for s in sides),
    }


def diff_trees(store: Store, root_a: uuid.UUID, root_b: uuid.UUID) -> dict[str, Any]:
    """The two trees side by side, paired by path (roots first, then by path).

    Raises:
        NotFound: either id is not a task.
        BadInput: either id is a task but not a root.

    """
    trees = []
    for root in (root_a, root_b):
        rows = store.reads.tree_rows(root)
        if not rows or rows[0]["root_id"] != root:
            what = store.reads.get(root)  # NotFound for an unknown id
            raise BadInput(f"task {root} is not a root (its root is {what['root_id']})")
        trees.append((_paths(rows), store.reads.call_counts(root)))
    (paths_a, calls_a), (paths_b, calls_b) = trees
    pairs = [_pair(p, _side(paths_a.get(p), calls_a), _side(paths_b.get(p), calls_b))
             for p in sorted(set(paths_a) | set(paths_b), key=lambda p: (p.count("/"), p))]
    side_a = [p["a"] for p in pairs if p["a"] is not None]
    side_b = [p["b"] for p in pairs if p["b"] is not None]
    return {"a": str(root_a), "b": str(root_b), "pairs": pairs,
            "totals": {"a": _totals(side_a), "b": _totals(side_b)}}


def _signed(value: float | int | Decimal, unit: str = "") -> str:
    return ("+" if value > 0 else "") + f"{value}{unit}" if value else "="


def diff_lines(diff: dict[str, Any]) -> list[str]:
    """The diff as plain text lines (``orgchart diff`` without ``--json``)."""
    lines = [f"A {diff['a']}", f"B {diff['b']}", ""]
    for pair in diff["pairs"]:
        a, b = pair["a"], pair["b"]
        if pair["only_in"]:
            one = a or b
            lines.append(f"{pair['path']}  only in {pair['only_in'].upper()}: "
                         f"{one['agent']} {one['status']}")
            continue
        changed = pair["changed"]
        marks = [name for name in ("version", "prompts") if changed[name]]
        status = a["status"] if a["status"] == b["status"] else f"{a['status']} -> {b['status']}"
        delta = pair["delta"]
        lines.append(
            f"{pair['path']}  {b['agent']}  {status}  tokens {a['own_tokens']} -> "
            f"{b['own_tokens']} ({_signed(delta['own_tokens'])})  cost "
            f"{_signed(Decimal(delta['own_usd']))}  time {_signed(delta['duration_seconds'], 's')}"
            f"  calls A {a['calls_paid']} paid / B {b['calls_paid']} paid, "
            f"{b['calls_replayed']} replayed"
            + (f"  CHANGED: {', '.join(marks)}" if marks else "")
            + ("  verdict differs" if changed["verdict"] else ""))
        lines.extend("    " + line for line in pair["result_diff"])
    ta, tb = diff["totals"]["a"], diff["totals"]["b"]
    lines += ["", f"A: {ta['tasks']} tasks, {ta['own_tokens']} tokens, ${ta['own_usd']}, "
                  f"{ta['calls_paid']} calls paid, {ta['calls_replayed']} replayed",
              f"B: {tb['tasks']} tasks, {tb['own_tokens']} tokens, ${tb['own_usd']}, "
              f"{tb['calls_paid']} calls paid, {tb['calls_replayed']} replayed"]
    return lines
