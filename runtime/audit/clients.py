"""Checks of what clients were told against what the database holds (a history's promises).

- **submits** (1): a submit told ``ok`` has its root (the id it was told), and a key names
  exactly that root; two submits told ``ok`` with different keys got different roots; a
  submit told ``fail`` with a key left no root with it (unless another submit with that
  key was not refused); one whose outcome is unknown (``info``) exists at most once,
  which the unique key guarantees and the lookup shows.
- **answers** (6): per task, the answers (``pending -> done``), approvals
  (``awaiting_approval -> pending``) and rejections (``awaiting_approval -> failed``)
  applied number at least the operations told ``ok`` and at most those plus the ones of
  unknown outcome; two clients are never both told ``ok`` for one task; one told ``fail``
  (a 4xx) changed nothing.
- **steering** (3, acknowledged cancels): after a cancel told ``ok``, its task is ended,
  and no task of its subtree is claimed or starts a model call.
- **duplicates** (4, the outside's record): a request a server answered twice (the same
  identity) was answered again only when a fault of the history fell between the two.
  It takes a request's identity (model, messages, format, options) for one call: two
  tasks that ask exactly the same thing would read as one call paid twice.
"""

from __future__ import annotations

import itertools
import uuid
from collections import Counter, defaultdict
from typing import Any

from runtime.audit.effects import call_start
from runtime.audit.facts import Row, Trees
from runtime.audit.history import History, Operation
from runtime.audit.lifecycle import TERMINAL
from runtime.audit.report import Report

#: The transition each steering operation applies.
APPLIES: dict[str, tuple[str, str]] = {"answer": ("pending", "done"),
                                       "approve": ("awaiting_approval", "pending"),
                                       "reject": ("awaiting_approval", "failed")}


def _uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except (TypeError, ValueError):
        return None


def submit_lookups(history: History) -> tuple[list[str], list[uuid.UUID]]:
    """The idempotency keys and ids a history's submits name (to read them once)."""
    ops = history.of("submit", "fork")
    keys = sorted({str(o.args["idempotency_key"]) for o in ops if o.args.get("idempotency_key")})
    ids = [i for o in ops if (i := _uuid(o.value.get("id"))) is not None]
    return keys, ids


def check_submits(history: History, by_key: list[Row], by_id: dict[uuid.UUID, Row],
                  report: Report) -> None:
    """Promise 1 (see the module docstring); ``by_key``/``by_id`` from facts.lookup."""
    roots_of_key: dict[str, list[Row]] = defaultdict(list)
    for row in by_key:
        roots_of_key[row["idempotency_key"]].append(row)
    told: dict[uuid.UUID, Operation] = {}
    ops = history.of("submit", "fork")
    refused_only = Counter(o.args.get("idempotency_key") for o in ops if o.outcome == "fail")
    for op in ops:
        report.checked["operations"] += 1
        key, tid = op.args.get("idempotency_key"), _uuid(op.value.get("id"))
        if op.outcome == "ok":
            _check_ok_submit(op, key, tid, by_id, roots_of_key, told, report)
        elif op.outcome == "fail" and key:
            others = sum(1 for o in ops if o.args.get("idempotency_key") == key) \
                - refused_only[key]
            if roots_of_key.get(key) and not others:
                report.add("submits", key, "a refused submit left a root", op.as_json(),
                           *({"root": r["id"]} for r in roots_of_key[key]))
        elif key and len(roots_of_key.get(key, ())) > 1:
            report.add("submits", key, "a submit of unknown outcome exists more than once",
                       op.as_json(), *({"root": r["id"]} for r in roots_of_key[key]))


def _check_ok_submit(op: Operation, key: Any, tid: uuid.UUID | None,
                     by_id: dict[uuid.UUID, Row], roots_of_key: dict[str, list[Row]],
                     told: dict[uuid.UUID, Operation], report: Report) -> None:
    if tid is None:
        report.add("submits", op.index, "a submit told ok but no task id", op.as_json())
        return
    row = by_id.get(tid)
    if row is None:
        report.add("submits", tid, "an acknowledged submit has no task", op.as_json())
        return
    if op.op == "submit" and row["parent_id"] is not None:
        report.add("submits", tid, "an acknowledged submit's task is not a root", op.as_json())
    if key:
        roots = roots_of_key.get(str(key), [])
        if [r["id"] for r in roots] != [tid]:
            report.add("submits", tid, f"key {key!r} names {len(roots)} root(s), not exactly "
                       "the one the client was told", op.as_json(),
                       *({"root": r["id"]} for r in roots))
    earlier = told.get(tid)
    if earlier is not None and earlier.args.get("idempotency_key") != key:
        report.add("submits", tid, "two submits with different keys were told one root",
                   earlier.as_json(), op.as_json())
    told[tid] = op


def check_answers(trees: Trees, history: History, report: Report) -> None:
    """Promise 6 on the tasks of ``trees`` (see the module docstring)."""
    by_task: dict[uuid.UUID, list[Operation]] = defaultdict(list)
    for op in history.of(*APPLIES):
        tid = _uuid(op.args.get("task"))
        if tid in trees.tasks:
            by_task[tid].append(op)
    for tid, ops in by_task.items():
        for kind, (frm, to) in APPLIES.items():
            mine = [o for o in ops if o.op == kind]
            if not mine:
                continue
            report.checked["operations"] += len(mine)
            applied = [e for e in trees.events.get(tid, [])
                       if e["from_status"] == frm and e["to_status"] == to]
            oks = [o for o in mine if o.outcome == "ok"]
            unknown = [o for o in mine if o.outcome == "info"]
            evidence = [o.as_json() for o in mine] + [
                {"event": e["id"], "from": frm, "to": to, "at": e["at"], "worker": e["worker"]}
                for e in applied]
            if len(oks) > 1:
                report.add("answers", tid, f"{len(oks)} clients were told their {kind} "
                           "was applied", *evidence)
            elif len(applied) < len(oks):
                report.add("answers", tid, f"{kind} told ok was never applied", *evidence)
            elif len(applied) > len(oks) + len(unknown):
                report.add("answers", tid, f"{kind} applied {len(applied)} time(s) but "
                           f"{len(oks)} client(s) were told ok", *evidence)


def check_cancel_acks(trees: Trees, history: History, slack: float, report: Report) -> None:
    """Promise 3 for cancels a client was told ``ok`` (see the module docstring)."""
    for op in history.of("cancel"):
        tid = _uuid(op.args.get("task"))
        if op.outcome != "ok" or op.completed is None or tid not in trees.tasks:
            continue
        report.checked["operations"] += 1
        at = op.completed
        if trees.tasks[tid]["status"] not in TERMINAL:
            report.add("steering", tid, "cancel told ok but the task is still "
                       f"{trees.tasks[tid]['status']!r}", op.as_json())
        for sub in trees.subtree(tid):
            for e in trees.events.get(sub, []):
                if e["to_status"] == "running" and e["at"] > at + slack:
                    report.add("steering", sub, "claimed after its cancel was acknowledged",
                               op.as_json(), {"event": e["id"], "at": e["at"],
                                              "worker": e["worker"], "detail": e["detail"]})
        late = {s for s in trees.subtree(tid)}
        for c in trees.calls:
            if c["task_id"] in late and not c["replayed"] and call_start(c) > at + slack:
                report.add("steering", c["task_id"], "model call started after its cancel "
                           "was acknowledged", op.as_json(),
                           {"call": c["id"], "started_by": call_start(c)})


def check_outside(history: History, slack: float, report: Report) -> None:
    """Promise 4 on the outside's record (see the module docstring)."""
    by_key: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in history.requests:
        by_key[(r.source, r.key)].append(r.at)
    report.checked["outside requests"] += len(history.requests)
    for (source, key), times in by_key.items():
        times.sort()
        for first, again in itertools.pairwise(times):
            faults = history.faults_between(first, again, slack)
            if faults:
                report.in_flight.append({"why": f"{source} answered again after a fault",
                                         "key": key, "at": again,
                                         "fault": faults[0].as_json()})
            else:
                report.add("duplicates", f"{source}:{key[:16]}", f"{source} answered one "
                           "request twice outside any fault window",
                           {"source": source, "key": key, "at": first},
                           {"source": source, "key": key, "at": again})
