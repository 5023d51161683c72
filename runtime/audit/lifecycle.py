"""The lifecycle's state machine (SPEC section 4) as the audit reads it from task_events.

Every ``(from_status, to_status)`` pair the runtime writes (``runtime/store/queries.sql``)
and why; an event path is legal when each event starts where the previous one ended and
its pair is listed here. Pure data: no database.
"""

from __future__ import annotations

#: Statuses that end a task (fan-in treats every one as finished).
TERMINAL: frozenset[str] = frozenset({"done", "failed", "escalated", "cancelled"})
#: Statuses a cancel ends (``task_cancel_subtree``).
CANCELLABLE: frozenset[str] = frozenset({"pending", "running", "waiting", "ready_to_aggregate",
                                         "judging", "awaiting_approval"})

#: The legal transitions, each with the statements that write it.
TRANSITIONS: frozenset[tuple[str | None, str]] = frozenset({
    # task_insert_root, task_insert_roots_many, task_insert_fork_root,
    # task_delegate_running_many (children; held ones for require_approval)
    (None, "pending"), (None, "awaiting_approval"),
    # the claims: a run from pending, an aggregate from ready_to_aggregate
    ("pending", "running"), ("ready_to_aggregate", "running"),
    # task_finish_running (a transient retry goes back to pending with backoff)
    ("running", "judging"), ("running", "done"), ("running", "failed"),
    ("running", "escalated"), ("running", "pending"),
    # task_delegate_running_many, task_retry_children
    ("running", "waiting"),
    # task_reap_expired, task_release_leased: back to where it was claimed from
    ("running", "ready_to_aggregate"), ("judging", "judging"),
    # task_finish_judging; task_reap_expired (poison)
    ("judging", "done"), ("judging", "failed"), ("judging", "escalated"),
    # task_flip_ready_parents, task_sweep_ready_parents; task_unready_parent
    ("waiting", "ready_to_aggregate"), ("ready_to_aggregate", "waiting"),
    # task_retry_children (an aggregate sends a failed child back)
    ("failed", "pending"), ("escalated", "pending"),
    # task_resolve_escalated
    ("escalated", "done"), ("escalated", "failed"),
    # task_approve_awaiting, task_reject_awaiting
    ("awaiting_approval", "pending"), ("awaiting_approval", "failed"),
    # task_answer_question, task_fail_unanswered (a question to 'human')
    ("pending", "done"), ("pending", "failed"),
    # task_cancel_subtree
    *((s, "cancelled") for s in CANCELLABLE),
})

#: The workers that write on a task they do not hold a lease on (maintenance passes).
MAINTENANCE_WORKERS: frozenset[str] = frozenset({"reaper", "watchdog", "sweeper"})
#: How the details of transitions out of ``running`` not written by its lease holder start.
NOT_BY_HOLDER: tuple[str, ...] = ("lease expired", "poison:", "timeout:")


def legal(from_status: str | None, to_status: str) -> bool:
    """Whether the runtime ever writes ``from_status -> to_status``."""
    return (from_status, to_status) in TRANSITIONS


def claimed_from(detail: str | None) -> str:
    """Where a claim event took its task from: ``pending`` (a run) or ``ready_to_aggregate``."""
    return "ready_to_aggregate" if (detail or "").startswith("claimed for aggregate") \
        else "pending"
