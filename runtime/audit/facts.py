"""What the database holds, read for the audit in bounded batches and never written.

:func:`tree_batches` pages through the roots (keyset on id) and, for each page of
``batch_roots`` trees, reads their tasks, events, model calls, steps and pauses, each
keyset-paged by ``page_rows``, in one READ ONLY, REPEATABLE READ transaction (one
snapshot: a task's status and its events agree). Every statement is a named block of
``runtime/store/queries.sql`` ("Audit"). Times are read as epoch seconds (floats), the
clock of a history's ``wall``.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection

from runtime.store.queries import TEXT
from runtime.store.store import Store

#: Trees read per transaction.
BATCH_ROOTS = 200
#: Rows per page of one read.
PAGE_ROWS = 5000

Row = dict[str, Any]


@dataclass
class Trees:
    """The facts of one batch of trees.

    Attributes:
        tasks: by id (``id, parent_id, root_id, status, to_agent, budget_*, ...``).
        events: each task's events in order (``at`` in epoch seconds).
        calls: the trees' model calls in id order (``created_at`` in epoch seconds).
        steps: the trees' durable steps (``started_at``, ``finished_at`` in epoch seconds).
        paused: the trees paused right now, and since when.

    """

    tasks: dict[uuid.UUID, Row] = field(default_factory=dict)
    events: dict[uuid.UUID, list[Row]] = field(default_factory=lambda: defaultdict(list))
    calls: list[Row] = field(default_factory=list)
    steps: list[Row] = field(default_factory=list)
    paused: dict[uuid.UUID, float] = field(default_factory=dict)

    def children(self) -> dict[uuid.UUID, list[uuid.UUID]]:
        """Each parent's children."""
        kids: dict[uuid.UUID, list[uuid.UUID]] = defaultdict(list)
        for task in self.tasks.values():
            if task["parent_id"] is not None:
                kids[task["parent_id"]].append(task["id"])
        return kids

    def subtree(self, top: uuid.UUID) -> list[uuid.UUID]:
        """``top`` and every task below it."""
        kids, out, todo = self.children(), [], [top]
        while todo:
            tid = todo.pop()
            out.append(tid)
            todo.extend(kids.get(tid, ()))
        return out


def _paged(conn: Connection, name: str, params: dict[str, Any], page: int,
           after: Callable[[Row], dict[str, Any]], start: dict[str, Any]) -> Iterator[Row]:
    """Every row of a keyset-paged named read, ``page`` at a time."""
    cursor = dict(start)
    while True:
        result = conn.execute(TEXT[name], {**params, **cursor, "limit": page})
        keys = list(result.keys())
        rows = [dict(zip(keys, row, strict=True)) for row in result.all()]
        yield from rows
        if len(rows) < page:
            return
        cursor = after(rows[-1])


def read_trees(conn: Connection, roots: Sequence[uuid.UUID], page: int = PAGE_ROWS) -> Trees:
    """The facts of the trees ``roots``, read on ``conn`` (already read-only)."""
    trees = Trees()
    ids = [str(r) for r in roots]
    for row in _paged(conn, "audit_tasks_page", {"roots": ids}, page,
                      lambda r: {"after": r["id"]}, {"after": uuid.UUID(int=0)}):
        trees.tasks[row["id"]] = row
    task_ids = [str(t) for t in trees.tasks]
    for row in _paged(conn, "audit_events_page", {"ids": task_ids}, page,
                      lambda r: {"after_task": r["task_id"], "after_id": r["id"]},
                      {"after_task": uuid.UUID(int=0), "after_id": 0}):
        trees.events[row["task_id"]].append(row)
    trees.calls = list(_paged(conn, "audit_calls_page", {"roots": ids}, page,
                              lambda r: {"after": r["id"]}, {"after": 0}))
    trees.steps = list(_paged(conn, "audit_steps_page", {"roots": ids}, page,
                              lambda r: {"after": r["id"]}, {"after": 0}))
    trees.paused = {r.root_id: r.paused_at for r in conn.execute(
        TEXT["audit_pauses_of_roots"], {"roots": ids})}
    return trees



def tree_batches(store: Store, roots: Sequence[uuid.UUID] | None = None,
                 since: dt.datetime | None = None, batch: int = BATCH_ROOTS,
                 page: int = PAGE_ROWS) -> Iterator[Trees]:
    """The facts of the named trees (or of every tree, or those since ``since``), by batch."""
    if roots is not None:
        for i in range(0, len(roots), batch):
            with store.database.transaction() as conn:
                conn.execute(TEXT["audit_begin_read_only"])
                yield read_trees(conn, roots[i:i + batch], page)
        return
    after = uuid.UUID(int=0)
    while True:
        with store.database.transaction() as conn:
            conn.execute(TEXT["audit_begin_read_only"])
            ids = [r.id for r in conn.execute(TEXT["audit_roots_page"],
                                              {"after": after, "since": since, "limit": batch})]
            if not ids:
                return
            trees = read_trees(conn, ids, page)
        yield trees
        if len(ids) < batch:
            return
        after = ids[-1]


def lookup(store: Store, keys: Sequence[str], ids: Sequence[uuid.UUID]
           ) -> tuple[list[Row], dict[uuid.UUID, Row]]:
    """The roots holding ``keys`` and the tasks ``ids`` (a history's submits and targets)."""
    with store.database.transaction() as conn:
        conn.execute(TEXT["audit_begin_read_only"])
        by_key = [dict(r._mapping) for r in conn.execute(
            TEXT["audit_roots_by_keys"], {"keys": list(keys)})]
        by_id = {r.id: dict(r._mapping) for r in conn.execute(
            TEXT["audit_tasks_by_ids"], {"ids": [str(i) for i in ids]})}
    return by_key, by_id
