"""The public JSON shapes (SPEC section 10): a task, a tree with totals, an event.

Fields may be added, never renamed. ``spent_tokens``/``spent_usd`` on a node are its
subtree's spend (its own model calls plus its descendants'); ``own_tokens``/``own_usd``
are its own. The root's ``totals`` sum every node's own spend, so they equal the root's
``spent_*``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import uuid
from collections import Counter
from decimal import Decimal
from typing import Any

from runtime.errors import BadInput
from runtime.store.rows import TERMINAL_STATUSES, NotFound, served_totals
from runtime.store.store import Store

TASK_FIELDS = (
    "id", "root_id", "parent_id", "agent", "type", "status", "priority", "payload", "result",
    "error", "verdict", "spent_tokens", "spent_usd", "duration_seconds", "route", "model",
    "created_at", "started_at", "completed_at",
)


def _scalar(value: Any) -> Any:
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, Decimal):
        return format(value.normalize(), "f") if value == value.to_integral() else str(value)
    return value


def money(value: Any) -> str:
    """USD as a fixed 8-decimal string (no float rounding)."""
    return f"{Decimal(value or 0):.8f}"


def task_json(row: dict[str, Any]) -> dict[str, Any]:
    """One task in the public shape."""
    return {
        "id": _scalar(row["id"]),
        "root_id": _scalar(row["root_id"]),
        "parent_id": _scalar(row.get("parent_id")),
        "agent": row["to_agent"],
        "type": row["type"],
        "status": row["status"],
        "priority": row.get("priority"),
        "tenant": row.get("tenant", "default"),
        "payload": row.get("payload"),
        "result": row.get("result"),
        "error": row.get("error"),
        "verdict": row.get("verdict"),
        "spent_tokens": int(row.get("spent_tokens") or 0),
        "spent_usd": money(row.get("spent_usd")),
        "own_tokens": int(row.get("own_tokens") or 0),
        "own_usd": money(row.get("own_usd")),
        "duration_seconds": round(float(row.get("duration_seconds") or 0.0), 6),
        "route": row.get("route"),
        "route_reason": row.get("route_reason"),
        "model": row.get("model"),
        "served_by": row.get("served_by"),
        "cost_estimated": bool(row.get("cost_estimated")),
        "created_at": _scalar(row.get("created_at")),
        "started_at": _scalar(row.get("started_at")),
        "completed_at": _scalar(row.get("completed_at")),
        "depth": row.get("depth"),
        "from_agent": row.get("from_agent"),
        "key": row.get("idempotency_key") if row.get("parent_id") else None,
        "idempotency_key": row.get("idempotency_key") if not row.get("parent_id") else None,
        "budget_tokens": row.get("budget_tokens"),
        "budget_seconds": row.get("budget_seconds"),
        "budget_usd": _scalar(row.get("budget_usd")),
        "success_criteria": row.get("success_criteria"),
        "kill_criteria": row.get("kill_criteria"),
        "retry_count": row.get("retry_count"),
        "delivery_count": row.get("delivery_count"),
        "forked_from": _scalar(row.get("forked_from")),
        "fork": row.get("fork"),
        "agent_version": row.get("agent_version"),
        "prompt_hashes": row.get("prompt_hashes"),
    }


def tree_json(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Nest a tree's rows (from ``store.reads.tree_rows``) under its root, with totals."""
    if not rows:
        return None
    nodes = {row["id"]: {**task_json(row), "children": []} for row in rows}
    root: dict[str, Any] | None = None
    for row in rows:
        node = nodes[row["id"]]
        parent = nodes.get(row.get("parent_id")) if row.get("parent_id") else None
        if parent is None:
            root = node if root is None or row["id"] == row["root_id"] else root
        else:
            parent["children"].append(node)
    assert root is not None
    root["totals"] = {
        "tasks": len(rows),
        "by_status": dict(Counter(r["status"] for r in rows)),
        "spent_tokens": sum(int(r.get("own_tokens") or 0) for r in rows),
        "spent_usd": money(sum((Decimal(r.get("own_usd") or 0) for r in rows), Decimal(0))),
        "duration_seconds": round(sum(float(r.get("duration_seconds") or 0) for r in rows), 6),
        **served_totals((r.get("served_by"), r.get("cost_estimated"), r.get("own_usd"))
                        for r in rows),
    }
    return root


def event_json(row: dict[str, Any]) -> dict[str, Any]:
    """One ``task_events`` row."""
    return {k: _scalar(row.get(k)) for k in ("id", "task_id", "from_status", "to_status", "at",
                                             "worker", "detail")}


def model_call_json(row: dict[str, Any]) -> dict[str, Any]:
    """One ``model_calls`` row: one request of a model call.

    ``attempt_kind`` is ``call``, ``retry`` or ``repair``; ``replayed`` rows were served
    from the record of an earlier delivery and charged zero.
    """
    out = {k: _scalar(row.get(k)) for k in (
        "id", "attempt", "call_index", "backend", "route", "model", "prompt", "response",
        "prompt_tokens", "completion_tokens", "duration_seconds", "error", "created_at",
        "phase", "position", "attempt_kind", "call_try", "thinking")}
    out["cost_usd"] = money(row.get("cost_usd"))
    out["replayed"] = bool(row.get("replayed"))
    out["thinking_present"] = bool(row.get("thinking"))
    return out


#: How much of a step's arguments and result the JSON of a task shows.
STEP_SHOWN_CHARS = 500


def _capped(value: Any, limit: int = STEP_SHOWN_CHARS) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, default=str,
                                                         ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def approval_json(row: dict[str, Any]) -> dict[str, Any]:
    """One ``tool_approvals`` row: a tool call that asked for a person, and the decision."""
    out = {k: _scalar(row.get(k)) for k in (
        "phase", "call_id", "tool", "args_hash", "status", "asked_at", "decided_at",
        "decided_by", "note")}
    out["args"] = _capped(row.get("args"))
    return out


def step_json(row: dict[str, Any]) -> dict[str, Any]:
    """One ``task_steps`` row: a durable step or a tool call, its arguments and result capped.

    ``replayed`` says its result was served from the record at least once (``replays``
    times); ``starts`` > 1 says it ran again after a delivery that died inside it.
    """
    out = {k: _scalar(row.get(k)) for k in (
        "id", "phase", "position", "name", "kind", "status", "tool_call_id", "error",
        "idempotency_key", "attempt", "starts", "replays", "tries", "duration_seconds",
        "started_at", "finished_at")}
    out["args"] = _capped(row.get("args"))
    out["result"] = _capped(row.get("result"))
    out["cost_usd"] = money(row.get("cost_usd"))
    out["replayed"] = int(row.get("replays") or 0) > 0
    return out


_POLICY_RULE = re.compile(r"^policy ([^\s:]+):")


def parse_task_id(text: str, what: str = "task id") -> uuid.UUID:
    """Parse a task id; raise :class:`BadInput` naming the bad value otherwise."""
    try:
        return uuid.UUID(text.strip())
    except (ValueError, AttributeError):
        raise BadInput(f"{what} {text!r} is not a UUID (expected something like "
                       "0b7c1e5e-3f4a-4b8e-9d2a-6f1c2b3a4d5e)") from None


def policy_rule(error: str | None) -> str | None:
    """The rule named by an error of the form ``policy <rule>: ...``, else None."""
    match = _POLICY_RULE.match(error or "")
    return match.group(1) if match else None


def escalation_json(row: dict[str, Any]) -> dict[str, Any]:
    """One entry of the escalation inbox: the task plus its rule, root goal and since when."""
    root_payload = row.get("root_payload")
    goal = root_payload.get("goal") if isinstance(root_payload, dict) else None
    escalated_at = row.get("escalated_at")
    return {
        **task_json(row),
        "rule": policy_rule(row.get("error")),
        "root_goal": goal,
        "escalated_at": escalated_at.isoformat() if escalated_at is not None else None,
    }


def _not_a_root(store: Store, root_id: uuid.UUID) -> NotFound:
    task = store.reads.get(root_id)  # raises NotFound "no task ..."
    return NotFound(f"task {root_id} is not a root; its tree is {task['root_id']}")


_NEVER = math.inf


def assemble_tree(rows: list[tuple[Any, ...]], top: uuid.UUID) -> str | None:
    """Nest node JSON texts from ``store.reads.tree_json_rows`` under ``top``, as one JSON text.

    The database built every node (and the totals), each left open (no closing brace);
    this only appends each node's children, in creation order, and closes it, without
    parsing or copying any node's text until the one join at the end.
    """
    top_id = str(top)
    totals = ""
    texts: dict[str, str] = {}
    kids: dict[str, list[tuple[Any, str]]] = {}
    for row in rows:  # (id, parent_id, depth, created_at as epoch seconds, json_text, ...)
        node_id, parent_id, created, text = row[0], row[1], row[3], row[4]
        if node_id is None:
            totals = text
            continue
        texts[node_id] = text
        if node_id != top_id:  # PostgreSQL sorts a NULL created_at last
            kids.setdefault(parent_id, []).append(
                (_NEVER if created is None else created, node_id))
    if top_id not in texts:
        return None
    # Depth-first without recursion (a chain of any depth), emitting fragments that are
    # joined once at the end: a single allocation of the whole text. A stack item is a
    # node with the text to put before it ("," between siblings), or a closing text; a
    # leaf (most nodes) is closed at once.
    parts: list[str] = []
    append = parts.append
    stack: list[tuple[str, str] | str] = [("", top_id)]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            append(item)
            continue
        before, node_id = item
        mine = kids.get(node_id)
        if before:
            append(before)
        append(texts[node_id])
        if node_id == top_id:
            append(',"children":[')
            stack.append('],"totals":' + totals + "}")
        elif not mine:
            append(',"children":[]}')
            continue
        else:
            append(',"children":[')
            stack.append("]}")
        if mine:
            mine.sort(reverse=True)
            last = len(mine) - 1
            stack.extend([("," if n < last else "", child)
                          for n, (_, child) in enumerate(mine)])
    return "".join(parts)


#: The shapes of a tree read: every field (the default), or the summary (no payload,
#: result or verdict on the nodes; see ``fragment_task_summary_json`` in queries.sql).
TREE_FIELDS = ("full", "summary")


def tree_text(store: Store, root_id: uuid.UUID, under: uuid.UUID | None = None,
              depth: int | None = None, fields: str = "full") -> tuple[str, int]:
    """The tree under ``root_id`` (or the subtree under ``under``) as JSON text.

    The same shape and values as :func:`tree_json` of the rows (``totals`` on the top
    node count what was fetched), read in one query that builds the JSON in the database.
    With ``fields="summary"`` each node is in the summary shape instead (docs/api.md: no
    payload, result, verdict, criteria, budgets or timestamps; with ``goal``,
    ``has_result``, ``verdict_passed`` and ``verdict_score``). Returns the text and the newest
    ``task_events`` id at the time of the read (follow the tree from there with
    ``store.reads.tree_changes``).

    Raises:
        BadInput: ``depth`` below 0, or ``fields`` not one of :data:`TREE_FIELDS`.
        NotFound: no such task, the task is not a root, or ``under`` is not in the tree.

    """
    if depth is not None and depth < 0:
        raise BadInput(f"depth must be 0 or more, not {depth}")
    if fields not in TREE_FIELDS:
        raise BadInput(f"fields must be one of {', '.join(TREE_FIELDS)}, not {fields!r}")
    rows = store.reads.tree_json_rows(root_id, under, depth, summary=fields == "summary")
    text = assemble_tree(rows, under or root_id)
    if text is not None:
        return text, int(next(row[5] for row in rows if row[0] is None))
    if under is not None and len(store.reads.tree_json_rows(root_id, None, 0)) > 1:
        raise NotFound(f"task {under} is not in tree {root_id}")
    raise _not_a_root(store, root_id)


def tree_for(store: Store, root_id: uuid.UUID) -> dict[str, Any]:
    """The tree under ``root_id`` in the public shape.

    Raises:
        NotFound: no such task, or the task is not a root (the message names its root).

    """
    return json.loads(tree_text(store, root_id)[0])  # type: ignore[no-any-return]


def tree_changes_json(store: Store, root_id: uuid.UUID, after: int,
                      limit: int = 5000) -> dict[str, Any]:
    """What changed in a tree after event ``after``: its events and the changed tasks.

    ``tasks`` are the changed tasks' current rows in the task shape (no ``children``);
    ``last_event_id`` is the cursor for the next call (``after`` again when nothing
    changed); ``more`` says the page was cut at ``limit`` events.
    """
    events = store.reads.tree_changes(root_id, after, limit)
    ids = list(dict.fromkeys(e["task_id"] for e in events))
    return {
        "root_id": str(root_id),
        "after": after,
        "last_event_id": int(events[-1]["id"]) if events else after,
        "more": len(events) >= limit,
        "events": [event_json(e) for e in events],
        "tasks": [task_json(t) for t in store.reads.tasks_by_ids(ids)],
    }


def task_detail_json(store: Store, task_id: uuid.UUID, model_calls: bool = True) -> dict[str, Any]:
    """A task with its transitions, children, steps and, when asked, its model calls.

    ``steps`` lists its durable steps and tool calls, arguments and results capped;
    ``tool_approvals`` the tool calls that asked for a person's approval, and the decisions.
    """
    task = store.reads.get(task_id)
    detail = task_json(task)
    detail["events"] = [event_json(e) for e in store.reads.events(task_id)]
    detail["children"] = [{"id": str(c["id"]), "agent": c["to_agent"], "status": c["status"]}
                          for c in store.reads.children(task_id)]
    if model_calls:
        detail["model_calls"] = [model_call_json(c) for c in store.reads.model_calls(task_id)]
    detail["steps"] = [step_json(s) for s in store.steps.for_task(task_id)]
    detail["tool_approvals"] = [approval_json(a) for a in store.steps.tool_approvals(task_id)]
    return detail


class TreeFollower:
    """A live tree kept current by its change feed: read whole once, then what changed.

    Each :meth:`refresh` asks ``store.reads.tree_changes`` for the transitions after the last
    event seen and patches the changed tasks into the tree in memory (new children in
    creation order), recomputing ``totals``. It reads the whole tree again every
    ``full_every`` refreshes and once when the root has finished, which also picks up
    what has no event of its own (spend rolled up into ancestors).
    """

    def __init__(self, store: Store, root_id: uuid.UUID, full_every: int = 30) -> None:
        self.store = store
        self.root_id = root_id
        self.full_every = full_every
        self.tree: dict[str, Any] | None = None
        self._nodes: dict[str, dict[str, Any]] = {}
        self._cursor = 0
        self._polls = 0
        self._final = False

    def _read_whole(self) -> None:
        text, self._cursor = tree_text(self.store, self.root_id)
        self.tree = json.loads(text)
        self._polls = 0
        self._nodes = {}
        stack = [self.tree]
        while stack:
            node = stack.pop()
            self._nodes[node["id"]] = node
            stack.extend(node["children"])

    def _apply(self, rows: list[dict[str, Any]]) -> bool:
        for row in rows:
            task = json.loads(json.dumps(task_json(row), default=str))
            known = self._nodes.get(task["id"])
            if known is not None:
                known.update(task)
                continue
            parent = self._nodes.get(task["parent_id"] or "")
            if parent is None:
                return False
            node = {**task, "children": []}
            parent["children"].append(node)
            parent["children"].sort(key=lambda n: (n["created_at"] or "", n["id"]))
            self._nodes[node["id"]] = node
        return True

    def _totals(self) -> dict[str, Any]:
        nodes = self._nodes.values()
        return {
            "tasks": len(self._nodes),
            "by_status": dict(Counter(n["status"] for n in nodes)),
            "spent_tokens": sum(int(n.get("own_tokens") or 0) for n in nodes),
            "spent_usd": money(sum((Decimal(n.get("own_usd") or 0) for n in nodes),
                                   Decimal(0))),
            "duration_seconds": round(sum(float(n.get("duration_seconds") or 0)
                                          for n in nodes), 6),
            **served_totals((n.get("served_by"), n.get("cost_estimated"), n.get("own_usd"))
                            for n in nodes),
        }

    def refresh(self) -> dict[str, Any]:
        """The tree as it is now (the public tree shape, ``totals`` on the root)."""
        whole = self.tree is None or self._polls >= self.full_every
        if whole:
            self._read_whole()
        else:
            self._polls += 1
            while True:
                events = self.store.reads.tree_changes(self.root_id, self._cursor)
                if not events:
                    break
                self._cursor = int(events[-1]["id"])
                ids = list(dict.fromkeys(e["task_id"] for e in events))
                if not self._apply(self.store.reads.tasks_by_ids(ids)):
                    self._read_whole()
                    break
            assert self.tree is not None
            self.tree["totals"] = self._totals()
        assert self.tree is not None
        if self.tree["status"] in TERMINAL_STATUSES and not self._final:
            self._final = True
            if not whole:
                self._read_whole()
        return self.tree


def timeline_for(store: Store, root_id: uuid.UUID) -> str:
    """The tree on a time axis with its critical path, as JSON text (``/timeline``).

    Raises:
        NotFound: no such task, or the task is not a root.

    """
    from runtime.telemetry.critical_path import timeline_text

    rows = store.reads.timeline_rows(root_id)
    if not rows:
        raise _not_a_root(store, root_id)
    return timeline_text(rows, str(root_id))


def critical_path_summary(store: Store, root_id: uuid.UUID) -> str:
    """One line: ``critical path 2.1 s of 2.4 s; 0.3 s queued (planner > lead > ...)``.

    Raises:
        NotFound: no such task, or the task is not a root.

    """
    from runtime.telemetry.critical_path import critical_path

    rows = store.reads.timeline_rows(root_id)
    if not rows:
        raise _not_a_root(store, root_id)
    return critical_path(rows, str(root_id)).summary()


def inbox_json(row: dict[str, Any]) -> dict[str, Any]:
    """One entry of ``orgchart inbox`` / ``GET /inbox``: a question, approval or escalation.

    ``question`` is what a person is asked: the question's text, what an approval would
    let run, or why the task escalated; ``answer_schema`` and ``choices`` shape a
    question's answer; ``age_seconds`` counts from when it started waiting.
    """
    raw = row.get("payload")
    payload: dict[str, Any] = raw if isinstance(raw, dict) else {}
    root_payload = row.get("root_payload")
    kind = row["kind"]
    if kind == "question":
        question = payload.get("question")
    elif kind == "approval":
        question = (f"approve running {row['to_agent']} ({row['type']}) for "
                    f"{row.get('from_agent') or 'a submitter'}?")
    else:
        question = row.get("error")
    return {
        "kind": kind,
        "id": str(row["id"]),
        "root_id": str(row["root_id"]),
        "parent_id": str(row["parent_id"]) if row.get("parent_id") else None,
        "asking_agent": row.get("from_agent"),
        "agent": row["to_agent"],
        "question": question,
        "answer_schema": payload.get("answer_schema") if kind == "question" else None,
        "choices": payload.get("choices") if kind == "question" else None,
        "payload": payload,
        "root_goal": root_payload.get("goal") if isinstance(root_payload, dict) else None,
        "deadline_seconds": row.get("budget_seconds") if kind == "question" else None,
        "created_at": _scalar(row.get("created_at")),
        "age_seconds": round(float(row["age_seconds"]), 3),
    }


def steer_json(outcome: Any) -> dict[str, Any]:
    """What a steering command did (cancel, pause, resume, approve, reject, answer)."""
    body: dict[str, Any] = {
        "task_id": str(outcome.task_id),
        "changed": bool(getattr(outcome, "changed", getattr(outcome, "cancelled", 0))),
        "status": outcome.status,
        "message": outcome.message,
        "parents_ready": [str(p) for p in outcome.parents_ready],
    }
    if hasattr(outcome, "cancelled"):
        body["cancelled"] = outcome.cancelled
    return body
