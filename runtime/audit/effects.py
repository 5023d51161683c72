"""Checks on side effects: steering (promise 3), duplicates (4) and fenced charges (7).

A model call's start is estimated as its row's ``created_at`` (the charge's transaction
start, after the reply) minus its ``duration_seconds``: never earlier than the real start.
Event times are their transaction's start too, so comparisons allow ``slack`` seconds.

- **steering**: no call of a cancelled task started after its cancel, no step began
  after it; in a tree paused now (``tree_pauses``) or during a history's pause (from the
  pause's ``ok`` to the resume's invocation), no claim and no call started. A call that
  started before and was recorded after is listed as in flight, not a violation.
- **duplicates**: two answered calls with one durable key (task, phase, position,
  request hash, kind, try), or a step started more than once, are allowed only when the
  first was in flight at a fault of the history (kill, restart, partition) or, without
  a history, when the task lost its lease (reaped, released) or was reopened in between.
  Never when the first was durable before the second was sent (its row's ``created_at``,
  its commit within ``slack``, before the second's start): an answer recorded is
  replayed, across any fault, so a call sent again after it is a violation.
- **fencing** (charges): every call charged and every step finished falls inside one of
  its task's deliveries (:func:`deliveries`: from a claim to the outcome that ends it; a
  running one for a run or aggregate, a judging one for the judge), or after its cancel
  (a call answered before a cancel is still paid).
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections import defaultdict
from typing import Any

from runtime.audit.facts import Row, Trees
from runtime.audit.history import History
from runtime.audit.report import Report

Interval = tuple[float, float, str]
#: One delivery of a task: ``(start, end, 'running' | 'judging', its lease token)``.
Delivery = tuple[float, float, str, uuid.UUID | None]
_LOST = ("lease expired", "released", "poison:", "timeout:")


def call_start(call: Row) -> float:
    """The latest moment a recorded call can have started (see the module docstring)."""
    return float(call["created_at"]) - float(call["duration_seconds"] or 0.0)


def _call(c: Row) -> dict[str, Any]:
    return {"call": c["id"], "task": c["task_id"], "phase": c["phase"], "position": c["position"],
            "attempt": c["attempt"], "kind": c["attempt_kind"], "try": c["call_try"],
            "started_by": call_start(c), "recorded_at": c["created_at"]}


def _step(s: Row) -> dict[str, Any]:
    return {"step": s["id"], "task": s["task_id"], "name": s["name"], "position": s["position"],
            "starts": s["starts"], "started_at": s["started_at"], "finished_at": s["finished_at"]}


def _ev(e: Row) -> dict[str, Any]:
    return {"event": e["id"], "task": e["task_id"], "from": e["from_status"],
            "to": e["to_status"], "at": e["at"], "worker": e["worker"], "detail": e["detail"]}


def deliveries(events: list[Row]) -> list[Delivery]:
    """A task's deliveries, ``(start, end, 'running' | 'judging', token)`` (end inf: open).

    A delivery starts at a claim (an event into ``running`` or ``judging``, carrying the
    new lease token; None before events carried tokens) and ends at the first event out
    of that status (its outcome, under the same token: checked by paths).
    """
    out: list[Delivery] = []
    opened: Row | None = None
    for e in events:
        if opened is not None and e["from_status"] == opened["to_status"]:
            out.append((opened["at"], e["at"], opened["to_status"], opened.get("lease_token")))
            opened = None
        if e["to_status"] in ("running", "judging") and opened is None:
            opened = e
    if opened is not None:
        out.append((opened["at"], math.inf, opened["to_status"], opened.get("lease_token")))
    return out


def leases(events: list[Row]) -> list[Interval]:
    """A task's leased intervals: ``(start, end, 'running' | 'judging')`` (end inf: open)."""
    return [(start, end, kind) for start, end, kind, _ in deliveries(events)]


def _cancelled_at(events: list[Row]) -> Row | None:
    return next((e for e in events if e["to_status"] == "cancelled"), None)


def check_steering(trees: Trees, history: History | None, slack: float, report: Report) -> None:
    """Promise 3 on ``trees``: after a cancel, and during pauses (database and history)."""
    calls_of: dict[uuid.UUID, list[Row]] = defaultdict(list)
    for c in trees.calls:
        if not c["replayed"]:
            calls_of[c["task_id"]].append(c)
    steps_of: dict[uuid.UUID, list[Row]] = defaultdict(list)
    for s in trees.steps:
        steps_of[s["task_id"]].append(s)
    for tid in trees.tasks:
        cancel = _cancelled_at(trees.events.get(tid, []))
        if cancel is not None:
            _nothing_after(tid, cancel["at"], _ev(cancel), calls_of[tid], [], steps_of[tid],
                           slack, report, "its cancel")
    windows = [(root, at, math.inf, {"paused since": at}) for root, at in trees.paused.items()]
    if history is not None:
        windows += _history_pauses(history, trees)
    for root, start, end, why in windows:
        for tid in (t for t, task in trees.tasks.items() if task["root_id"] == root):
            claims = [e for e in trees.events.get(tid, []) if e["to_status"] == "running"
                      and start + slack < e["at"] < end]
            _nothing_after(tid, start, why, [c for c in calls_of[tid] if call_start(c) < end],
                           claims, [s for s in steps_of[tid] if s["started_at"] < end],
                           slack, report, "its tree was paused")


def _nothing_after(tid: uuid.UUID, at: float, why: dict[str, Any], calls: list[Row],
                   claims: list[Row], steps: list[Row], slack: float, report: Report,
                   what: str) -> None:
    for e in claims:
        report.add("steering", tid, f"claimed after {what}", why, _ev(e))
    for c in calls:
        if call_start(c) > at + slack:
            report.add("steering", tid, f"model call started after {what}", why, _call(c))
        elif c["created_at"] > at:
            report.in_flight.append({"why": f"in flight at {what}", **_call(c)})
    for s in steps:
        if s["started_at"] > at + slack:
            report.add("steering", tid, f"step started after {what}", why, _step(s))


def _history_pauses(history: History, trees: Trees
                    ) -> list[tuple[uuid.UUID, float, float, dict[str, Any]]]:
    roots = {str(t["root_id"]): t["root_id"] for t in trees.tasks.values()}
    out = []
    for op in history.of("pause"):
        root = roots.get(str(op.args.get("root")))
        if op.outcome != "ok" or root is None or op.completed is None:
            continue
        resumes = [r.invoked for r in history.of("resume")
                   if str(r.args.get("root")) == str(root) and r.invoked >= op.completed]
        out.append((root, op.completed, min(resumes, default=math.inf), op.as_json()))
    return out


def _explained(tid: uuid.UUID, start: float, end: float, trees: Trees,
               history: History | None, slack: float) -> dict[str, Any] | None:
    """What explains running a side effect again between ``start`` and ``end``, if anything."""
    if history is not None and history.faults:
        faults = history.faults_between(start, end, slack)
        return faults[0].as_json() if faults else None
    for e in trees.events.get(tid, []):
        if start - slack <= e["at"] <= end + slack and (
                (e["detail"] or "").startswith(_LOST)
                or (e["from_status"] in ("failed", "escalated") and e["to_status"] == "pending")):
            return _ev(e)
    return None


def check_duplicates(trees: Trees, history: History | None, slack: float,
                     report: Report) -> None:
    """Promise 4: calls paid twice and steps run twice, each explained by a fault or not."""
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for c in trees.calls:
        report.checked["calls"] += 1
        if c["answered"] and not c["replayed"]:
            groups[(c["task_id"], c["phase"], c["position"], c["request_hash"],
                    c["attempt_kind"], c["call_try"])].append(c)
    for same in groups.values():
        same.sort(key=lambda c: c["created_at"])
        for first, again in itertools.pairwise(same):
            if first["created_at"] + slack < call_start(again):
                report.add("duplicates", first["task_id"], "model call sent again after its "
                           "answer was durable", _call(first), _call(again))
                continue
            why = _explained(first["task_id"], call_start(first), call_start(again), trees,
                             history, slack)
            if why is None:
                report.add("duplicates", first["task_id"], "model call paid twice outside "
                           "any fault window", _call(first), _call(again))
            else:
                report.in_flight.append({"why": "paid again after a fault", "fault": why,
                                         **_call(again)})
    for s in trees.steps:
        report.checked["steps"] += 1
        if s["starts"] <= 1:
            continue
        events = trees.events.get(s["task_id"], [])
        claimed = next((e["at"] for e in events if e["to_status"] == "running"),
                       s["started_at"])
        why = _explained(s["task_id"], claimed, s["started_at"], trees, history, slack)
        if why is None:
            report.add("duplicates", s["task_id"], f"step started {s['starts']} times outside "
                       "any fault window", _step(s))
        else:
            report.in_flight.append({"why": "step run again after a fault", "fault": why,
                                     **_step(s)})


def check_fenced_charges(trees: Trees, slack: float, report: Report) -> None:
    """Promise 7's charges: every call and finished step inside one of its task's deliveries."""
    spans = {tid: leases(trees.events.get(tid, [])) for tid in trees.tasks}
    cancels = {tid: _cancelled_at(trees.events.get(tid, [])) for tid in trees.tasks}

    def fenced(tid: uuid.UUID, at: float, kind: str) -> bool:
        cancel = cancels.get(tid)
        if cancel is not None and at >= cancel["at"] - slack:
            return True
        return any(s - slack <= at <= e + slack for s, e, k in spans.get(tid, ()) if k == kind)

    for c in trees.calls:
        kind = "judging" if c["phase"] == "judge" else "running"
        if not c["replayed"] and not fenced(c["task_id"], c["created_at"], kind):
            report.add("fencing", c["task_id"], "model call charged outside any lease of "
                       "its task", _call(c))
    for s in trees.steps:
        if s["finished_at"] is not None and s["status"] == "finished" \
                and not fenced(s["task_id"], s["finished_at"], "running"):
            report.add("fencing", s["task_id"], "step finished outside any lease of its task",
                       _step(s))
