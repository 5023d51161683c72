"""Checks on each task's event path: the lifecycle (promise 2) and fenced outcomes (7).

- **paths**: a task's events start with its insertion, each starts where the previous one
  ended, each is a transition of :data:`runtime.audit.lifecycle.TRANSITIONS`, the last
  ends in the task's status; a task released by the reaper or a shutdown goes back to
  where it was claimed from; only a question to ``human`` is answered from ``pending``;
  ``waiting -> ready_to_aggregate`` comes after every child's event that ended it.
  Terminal events: one per outcome, since a terminal status is left only by a retry or a
  resolution (both listed transitions), so a second terminal event in a row is illegal.
- **fencing** (outcomes, per delivery): a transition out of ``running`` (but a cancel) is
  written under the lease token of the task's last claim: the worker's outcome under the
  token it held, the reaper's or the watchdog's under the token that expired
  (``task_events.lease_token``, migration 0016). Events written before tokens were
  recorded (a claim without one) fall back to workers: the outcome's worker (not the
  reaper, the watchdog or a cancel) is the one that wrote the claim.
"""

from __future__ import annotations

import uuid
from typing import Any

from runtime.audit.facts import Row, Trees
from runtime.audit.lifecycle import NOT_BY_HOLDER, TERMINAL, claimed_from, legal
from runtime.audit.report import Report


def _ev(e: Row) -> dict[str, Any]:
    return {"event": e["id"], "task": e["task_id"], "from": e["from_status"],
            "to": e["to_status"], "at": e["at"], "worker": e["worker"], "detail": e["detail"],
            "lease_token": e.get("lease_token")}


def check_paths(trees: Trees, report: Report) -> None:
    """Promise 2 and the outcome half of promise 7 on every task of ``trees``."""
    for tid, task in trees.tasks.items():
        events = trees.events.get(tid, [])
        report.checked["tasks"] += 1
        report.checked["events"] += len(events)
        if not events:
            report.add("paths", tid, f"task in status {task['status']!r} has no events",
                       {"task": tid, "status": task["status"]})
            continue
        _check_one_path(task, events, report)
    _check_fan_in(trees, report)


def _check_one_path(task: Row, events: list[Row], report: Report) -> None:
    tid = task["id"]
    prev: Row | None = None
    claim: Row | None = None
    for e in events:
        here = e["from_status"]
        if prev is None and here is not None:
            report.add("paths", tid, "first event does not insert the task", _ev(e))
        elif prev is not None and here != prev["to_status"]:
            report.add("paths", tid, f"event starts at {here!r} but the task was in "
                       f"{prev['to_status']!r}", _ev(prev), _ev(e))
        if not legal(here, e["to_status"]):
            report.add("paths", tid, f"illegal transition {here} -> {e['to_status']}",
                       *([_ev(prev)] if prev else []), _ev(e))
        elif here == "pending" and e["to_status"] in ("done", "failed") \
                and task["to_agent"] != "human":
            report.add("paths", tid, f"pending -> {e['to_status']} is only an answer to a "
                       f"question for 'human', not for {task['to_agent']!r}", _ev(e))
        if here == "running" and claim is not None:
            _check_leaving_running(tid, claim, e, report)
        if e["to_status"] == "running":
            claim = e
        prev = e
    if prev is not None and prev["to_status"] != task["status"]:
        report.add("paths", tid, f"last event ends in {prev['to_status']!r} but the task is "
                   f"{task['status']!r}", _ev(prev))


def _check_leaving_running(tid: uuid.UUID, claim: Row, e: Row, report: Report) -> None:
    to, detail = e["to_status"], e["detail"] or ""
    if to in ("pending", "ready_to_aggregate") and (
            detail.startswith("lease expired") or detail.startswith("released")):
        back = claimed_from(claim["detail"])
        if to != back:
            report.add("paths", tid, f"released to {to!r} but it was claimed from {back!r}",
                       _ev(claim), _ev(e))
    if to == "cancelled":
        return
    held = claim.get("lease_token")
    if held is not None:  # per delivery: the token of the last claim
        if e.get("lease_token") != held:
            report.add("fencing", tid, f"outcome written under token {e.get('lease_token')} "
                       f"while the task's last claim holds {held}", _ev(claim), _ev(e))
        return
    if detail.startswith(("lease expired", "released")) or detail.startswith(NOT_BY_HOLDER) \
            or e["worker"] in ("reaper", "watchdog"):
        return
    if e["worker"] != claim["worker"]:
        report.add("fencing", tid, f"outcome written by {e['worker']!r} while the lease was "
                   f"held by {claim['worker']!r}", _ev(claim), _ev(e))


def _check_fan_in(trees: Trees, report: Report) -> None:
    for parent, kids in trees.children().items():
        flips = [e for e in trees.events.get(parent, [])
                 if e["from_status"] == "waiting" and e["to_status"] == "ready_to_aggregate"]
        for flip in flips:
            for kid in kids:
                before = [e for e in trees.events.get(kid, []) if e["id"] < flip["id"]]
                if before and before[-1]["to_status"] not in TERMINAL:
                    report.add("paths", parent, "fan-in before a child was terminal",
                               _ev(before[-1]), _ev(flip))
