"""Where a tree's time went: per-task phases on a time axis, and the critical path.

The database gives one row per task (``store.reads.timeline_rows``, query ``timeline_tree``):
its phases from its transitions (``queued``: pending or ready to aggregate; ``running``;
``waiting`` for its children; ``judging``; each lasting until the next transition, an
unfinished task's last one until now), its model calls (a call's row is written when it
returns: it ends at ``created_at`` and lasted ``duration_seconds``), when it last left
``waiting`` (``resumed``), and its seconds in every phase but waiting (``own``) and
queued. This module, in Python:

- the **critical path** is the chain of tasks that decided when the root finished: from
  the root, repeatedly the child whose completion was the last one before the parent
  resumed, down to a task without children;
- its **summary**: the time the path's tasks spent on their own (every phase but
  ``waiting``, which their child on the path covers), of the root's wall time, and how
  much of that was queueing: ``critical path 2.1 s of 2.4 s; 0.3 s queued``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_FINAL = ("done", "failed", "escalated")


@dataclass
class CriticalPath:
    """The critical path and its summary numbers (seconds)."""

    tasks: list[str]
    agents: list[str]
    seconds: float
    total_seconds: float
    queued_seconds: float
    finished: bool

    def summary(self) -> str:
        """``critical path 2.1 s of 2.4 s; 0.3 s queued`` (plus the agents on it)."""
        text = (f"critical path {self.seconds:.1f} s of {self.total_seconds:.1f} s; "
                f"{self.queued_seconds:.1f} s queued")
        if self.agents:
            chain = " > ".join(self.agents[:6]) + (" > ..." if len(self.agents) > 6 else "")
            text += f" ({chain})"
        return text + ("" if self.finished else " so far")


def critical_path(rows: Sequence[Mapping[str, Any]], root_id: str) -> CriticalPath:
    """The chain of tasks that decided when the root finished, and its summary.

    ``rows`` are ``store.reads.timeline_rows``; ids are text.
    """
    by_id = {r["id"]: r for r in rows}
    root = by_id[root_id]
    now = float(root["now"])
    children: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["parent_id"] is not None:
            children[r["parent_id"]].append(r)
    path = [root]
    seen = {root_id}
    node = root
    while children.get(node["id"]):
        horizon = node["resumed"] if node["resumed"] is not None else now
        kids = children[node["id"]]
        before = [k for k in kids if k["finish"] is not None and k["finish"] <= horizon]
        nxt = max(before or kids, key=lambda k: (
            k["finish"] if k["finish"] is not None else now, k["start"], k["id"]))
        if nxt["id"] in seen:
            break
        seen.add(nxt["id"])
        path.append(nxt)
        node = nxt
    finished = root["status"] in _FINAL and root["finish"] is not None
    end = root["finish"] if finished else now
    return CriticalPath([r["id"] for r in path], [r["agent"] for r in path],
                        sum(float(r["own"]) for r in path), max(0.0, end - root["start"]),
                        sum(float(r["queued"]) for r in path), finished)


def timeline_text(rows: Sequence[Mapping[str, Any]], root_id: str) -> str:
    """The tree on a time axis for the page, as JSON text.

    ``{"root_id", "t0", "now", "end", "finished", "summary", "critical_path": [ids],
    "critical": {"seconds", "total_seconds", "queued_seconds", "agents"}, "tasks":
    [{"id", "parent_id", "agent", "status", "depth", "start", "end", "segments",
    "calls"}]}``: seconds from the root's creation; tasks parents first, then by start.
    """
    path = critical_path(rows, root_id)
    root = next(r for r in rows if r["id"] == root_id)
    ordered = sorted(rows, key=lambda r: (r["depth"], r["start"], r["id"]))
    head = {
        "root_id": root_id, "t0": root["t0"].isoformat(), "now": round(root["now"], 3),
        "end": round(path.total_seconds, 3), "finished": path.finished,
        "summary": path.summary(), "critical_path": path.tasks,
        "critical": {"seconds": round(path.seconds, 3),
                     "total_seconds": round(path.total_seconds, 3),
                     "queued_seconds": round(path.queued_seconds, 3), "agents": path.agents},
    }
    return (json.dumps(head)[:-1] + ',"tasks":['
            + ",".join(r["json"] for r in ordered) + "]}")
