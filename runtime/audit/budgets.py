"""Promise 5: no prefix of a tree's charges past a budget; every carve fits its parent.

At every prefix of a run, no subtree's charges exceed its budget, and every delegation
carves its children's budgets out of what their parent had left.

A charge is a model call's row (tokens and ``cost_usd``, replays excluded: they cost
nothing) at its ``created_at``, or a finished step's ``cost_usd`` at its ``finished_at``.
A task's budget covers its whole subtree (runtime/budget.py), so for each task with a
budget the subtree's charges are summed in time order and the first charge that takes
the sum past ``budget_tokens`` or ``budget_usd`` is reported with the budget. Each wave
of children (those inserted by one delegation) must fit in the parent's budget minus the
subtree's charges before it.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from decimal import Decimal
from typing import Any

from runtime.audit.facts import Row, Trees
from runtime.audit.report import Report

Charge = tuple[float, int, Decimal, dict[str, Any]]


def _charges(trees: Trees) -> dict[uuid.UUID, list[Charge]]:
    own: dict[uuid.UUID, list[Charge]] = defaultdict(list)
    for c in trees.calls:
        if not c["replayed"]:
            own[c["task_id"]].append((c["created_at"], int(c["tokens"] or 0),
                                      Decimal(c["cost_usd"] or 0),
                                      {"call": c["id"], "task": c["task_id"],
                                       "at": c["created_at"], "tokens": c["tokens"],
                                       "usd": c["cost_usd"]}))
    for s in trees.steps:
        if s["finished_at"] is not None and s["cost_usd"]:
            own[s["task_id"]].append((s["finished_at"], 0, Decimal(s["cost_usd"]),
                                      {"step": s["id"], "task": s["task_id"],
                                       "at": s["finished_at"], "usd": s["cost_usd"]}))
    return own


def _subtree_charges(trees: Trees, own: dict[uuid.UUID, list[Charge]]
                     ) -> dict[uuid.UUID, list[Charge]]:
    """Each task's subtree's charges in time order (children before parents, bottom up)."""
    kids = trees.children()
    out: dict[uuid.UUID, list[Charge]] = {}
    order: list[uuid.UUID] = []
    todo = [t for t, task in trees.tasks.items() if task["parent_id"] is None]
    while todo:
        tid = todo.pop()
        order.append(tid)
        todo.extend(kids.get(tid, ()))
    for tid in reversed(order):
        merged = list(own.get(tid, ()))
        for kid in kids.get(tid, ()):
            merged.extend(out.get(kid, ()))
        merged.sort(key=lambda c: c[0])
        out[tid] = merged
    return out


def _budget(task: Row) -> dict[str, Any]:
    return {"task": task["id"], "budget_tokens": task["budget_tokens"],
            "budget_usd": task["budget_usd"]}


def check_budgets(trees: Trees, report: Report) -> None:
    """Promise 5 on ``trees`` (see the module docstring)."""
    subtree = _subtree_charges(trees, _charges(trees))
    for tid, task in trees.tasks.items():
        tokens, usd = 0, Decimal(0)
        for _at, t, u, evidence in subtree.get(tid, ()):
            tokens, usd = tokens + t, usd + u
            over_tokens = task["budget_tokens"] is not None and tokens > task["budget_tokens"]
            over_usd = task["budget_usd"] is not None and usd > task["budget_usd"]
            if over_tokens or over_usd:
                report.add("budgets", tid, f"subtree spent {tokens} tokens, ${usd} by this "
                           "charge: past its budget", _budget(task), evidence)
                break
    _check_carves(trees, subtree, report)


def _check_carves(trees: Trees, subtree: dict[uuid.UUID, list[Charge]], report: Report) -> None:
    for parent, kids in trees.children().items():
        task = trees.tasks[parent]
        # A wave: the children inserted by one delegation, the statement that also wrote
        # the parent's move to 'waiting' (the event nearest to the child's first one).
        moves = [e for e in trees.events.get(parent, []) if e["to_status"] == "waiting"]
        waves: dict[int, list[Row]] = defaultdict(list)
        starts: dict[int, float] = {}
        for kid in kids:
            born = (trees.events.get(kid) or [{"id": 0, "at": trees.tasks[kid]["created_at"]}])[0]
            move = min(moves, key=lambda e: abs(e["id"] - born["id"]), default=born)
            waves[move["id"]].append(trees.tasks[kid])
            starts[move["id"]] = min(starts.get(move["id"], move["at"]), born["at"])
        for wave_id, wave in sorted(waves.items()):
            at = starts[wave_id]
            spent = subtree.get(parent, ())
            tokens = sum(c[1] for c in spent if c[0] < at)
            usd = sum((c[2] for c in spent if c[0] < at), Decimal(0))
            for column, used in (("budget_tokens", tokens), ("budget_usd", usd)):
                asked = [k[column] for k in wave if k[column] is not None]
                if task[column] is None or not asked:
                    continue
                if sum(asked) > task[column] - used:
                    report.add("budgets", parent, f"children carved {sum(asked)} of "
                               f"{column} but the parent had {task[column] - used} left",
                               _budget(task), {"spent_before": used, "at": at},
                               *({"child": k["id"], column: k[column]} for k in wave))
