"""A cancel and a batched finish lock task rows in one order: deepest first, then by id.

The case that broke it: a cancel whose statement started while a delegation held the
parent's row. The cancel waited for the parent, then locked it; the children the
delegation inserted were not in its snapshot, so it took them in a later pass, after
the parent. A worker that claimed and finished one of those children meanwhile held the
child and waited for the parent (a finish locks the ended child, then its parent): each
held what the other waited for, and PostgreSQL aborted one (``deadlock_detected``,
40P01) after ``deadlock_timeout``. Now a delegation holds its trees' steering locks
shared, so a cancel (which takes its tree's exclusive) starts before it or after it
committed, and its one statement sees every child.

The interleaving is driven step by step: each step waits until the database shows the
session blocked (``pg_locks``), and the delegation pauses before its COMMIT on a hook of
the store's engine. No sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from runtime.store.postgres.failover import sqlstate
from runtime.store.queries import QUERIES
from runtime.store.rows import RunOutcome
from runtime.store.store import Store
from tests.factories import child_rows, parent_with_children
from tests.support import wait_until

DEADLOCK = "40P01"


class Step(threading.Thread):
    """A store call in a thread; its result or its error."""

    def __init__(self, call: Any, *args: Any) -> None:
        super().__init__(daemon=True)
        self.call, self.args = call, args
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.call(*self.args)
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.fixture
def deadlocks(store: Store) -> Iterator[list[BaseException]]:
    """Every deadlock error any statement of the store met (retried or not)."""
    seen: list[BaseException] = []

    def on_error(context: Any) -> None:
        if sqlstate(context.original_exception) == DEADLOCK:
            seen.append(context.original_exception)

    event.listen(store.engine, "handle_error", on_error)
    yield seen
    event.remove(store.engine, "handle_error", on_error)


class PausedDelegation:
    """Once armed, the next delegation stops before its COMMIT until :meth:`go`."""

    #: A line of task_delegate_running_many that no other statement has.
    MARKER = "children jsonb, stamp jsonb)"

    def __init__(self) -> None:
        assert self.MARKER in QUERIES["task_delegate_running_many"]
        self.armed = False
        self.reached, self._go = threading.Event(), threading.Event()

    def after_cursor_execute(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if self.armed and self.MARKER in statement:
            self.armed = False
            self.reached.set()
            assert self._go.wait(30), "the test never let the delegation commit"

    def go(self) -> None:
        self._go.set()


@pytest.fixture
def paused_delegation(store: Store) -> Iterator[PausedDelegation]:
    """A hook on the store's engine that holds a delegation open (see PausedDelegation)."""
    pause = PausedDelegation()
    event.listen(store.engine, "after_cursor_execute", pause.after_cursor_execute)
    yield pause
    pause.go()
    event.remove(store.engine, "after_cursor_execute", pause.after_cursor_execute)


def blocked(store: Store) -> int:
    """How many sessions of this database wait for a lock."""
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE NOT l.granted AND a.datname = current_database()")).scalar_one())


def test_a_cancel_and_the_finish_of_a_child_delegated_meanwhile_do_not_deadlock(
        store: Store, deadlocks: list[BaseException],
        paused_delegation: PausedDelegation) -> None:
    root, _ = parent_with_children(store, 2, agent="fanout")
    parent, sibling = sorted(store.claims.claim(["fanout"], 2, "w", 60), key=lambda r: r.id)
    with store.engine.connect() as holder:
        tx = holder.begin()  # holds the sibling: the cancel stops there, after the parent
        holder.execute(sa.text("SELECT 1 FROM tasks WHERE id = :id FOR UPDATE"),
                       {"id": sibling.id})
        paused_delegation.armed = True
        delegation = Step(store.transitions.delegate, parent.id, parent.lease, child_rows(1), "w")
        delegation.start()
        assert paused_delegation.reached.wait(30)  # it holds the parent, uncommitted
        cancel = Step(store.steering.cancel, root["id"])
        cancel.start()
        wait_until(lambda: blocked(store) == 1, what="the cancel to wait for the delegation")
        paused_delegation.go()
        delegation.join(30)
        assert delegation.error is None and delegation.result == (True, 1)
        wait_until(lambda: blocked(store) == 1, what="the cancel to wait for the sibling")
        # A worker takes the new child now, if the cancel does not hold it, and ends it.
        finish = None
        claimed = store.claims.claim(["echo"], 1, "w2", 60)
        if claimed:
            child = claimed[0]
            finish = Step(store.transitions.finish_running,
                          [RunOutcome(child.id, child.lease, "failed", error="x")], "w2")
            finish.start()
            wait_until(lambda: blocked(store) == 2 or not finish.is_alive(),
                       what="the finish to wait for the parent")
        tx.rollback()  # the cancel goes on
    cancel.join(30)
    if finish is not None:
        finish.join(30)
        assert finish.error is None, finish.error
    assert cancel.error is None, cancel.error
    assert deadlocks == []
    with store.engine.connect() as conn:
        statuses = conn.execute(sa.text("SELECT status FROM tasks WHERE root_id = :r"),
                                {"r": root["id"]}).scalars().all()
    assert len(statuses) == 4 and set(statuses) <= {"cancelled", "failed"}
