"""The schema as typed SQLAlchemy models; Alembic migrations create it, a test keeps them equal.

``tasks`` carries the seed's twenty columns exactly (seed 003), then the runtime's own:
leases and fencing, retries, idempotency, spend and routing, the judge's verdict.
``task_events`` is the append-only history (one row per transition, written in the
transition's transaction), ``model_calls`` records every model call, ``fires`` holds
one row per orchestrator fire, ``task_steps`` one per durable step or tool call.
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from typing import Annotated, Any

from sqlalchemy import TIMESTAMP as _TIMESTAMP
from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Numeric,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.dialects.postgresql import base as postgresql_base
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import UserDefinedType

from runtime.constants import DEFAULT_BUDGET_SECONDS, DEFAULT_BUDGET_TOKENS, DEFAULT_BUDGET_USD
from runtime.store.rows import STATUSES

TIMESTAMPTZ = _TIMESTAMP(timezone=True)

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

uuid_pk = Annotated[
    uuid.UUID,
    mapped_column(UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
]
jsonb = Annotated[Any, mapped_column(JSONB)]
created_at = Annotated[
    dt.datetime,
    mapped_column(TIMESTAMPTZ, server_default=text("now()")),
]
money = Annotated[Decimal, mapped_column(Numeric(16, 8), nullable=False, server_default="0")]


class Xid8(UserDefinedType[int]):
    """PostgreSQL's 64-bit transaction id (``xid8``); read as text, compared in SQL."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        """Return the column's SQL type."""
        return "xid8"


# Reflection (Alembic's comparison of models and migrations) knows the type by name.
postgresql_base.ischema_names.setdefault("xid8", Xid8)


#: The rows of ``ix_tasks_inbox``: open questions to a person and tasks held for approval.
INBOX_WHERE = ("status = 'awaiting_approval' OR (status = 'pending' AND to_agent = 'human')")


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


class Base(DeclarativeBase):
    """Declarative base with predictable constraint names."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Task(Base):
    """One unit of agent work; every message between agents is one of these rows."""

    __tablename__ = "tasks"

    # --- the seed's columns (seed 003), names, types and defaults exactly ---
    id: Mapped[uuid_pk]
    parent_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tasks.id")
    )
    root_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    from_agent: Mapped[str | None] = mapped_column(Text)
    to_agent: Mapped[str] = mapped_column(Text, nullable=False)
    type: Mapped[str] = mapped_column(Text, nullable=False)
    hypothesis_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    payload: Mapped[Any] = mapped_column(JSONB, nullable=False)
    success_criteria: Mapped[jsonb | None]
    kill_criteria: Mapped[jsonb | None]
    budget_tokens: Mapped[int | None] = mapped_column(Integer,
                                                       server_default=str(DEFAULT_BUDGET_TOKENS))
    budget_seconds: Mapped[int | None] = mapped_column(Integer,
                                                        server_default=str(DEFAULT_BUDGET_SECONDS))
    budget_usd: Mapped[Decimal | None] = mapped_column(
        Numeric(10, 4), server_default=str(DEFAULT_BUDGET_USD))
    status: Mapped[str] = mapped_column(Text, nullable=False, server_default="pending")
    priority: Mapped[int | None] = mapped_column(Integer, server_default="5")
    created_at: Mapped[created_at | None]
    started_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    completed_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    result: Mapped[jsonb | None]
    error: Mapped[str | None] = mapped_column(Text)

    # --- the runtime's columns ---
    depth: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    phase: Mapped[str] = mapped_column(Text, nullable=False, server_default="run")
    available_at: Mapped[dt.datetime] = mapped_column(
        TIMESTAMPTZ, nullable=False, server_default=text("now()")
    )
    lease_owner: Mapped[str | None] = mapped_column(Text)
    lease_token: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    claimed_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    delivery_count: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    retry_count: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    request_hash: Mapped[str | None] = mapped_column(Text)
    own_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    own_usd: Mapped[money]
    spent_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    spent_usd: Mapped[money]
    duration_seconds: Mapped[float] = mapped_column(Double, nullable=False, server_default="0")
    route: Mapped[str | None] = mapped_column(Text)
    route_reason: Mapped[str | None] = mapped_column(Text)
    model: Mapped[str | None] = mapped_column(Text)
    verdict: Mapped[jsonb | None]
    updated_at: Mapped[dt.datetime] = mapped_column(
        TIMESTAMPTZ, nullable=False, server_default=text("now()")
    )
    # --- the engine's (migration 0003) ---
    #: When a running task times out (set at claim: now() + budget_seconds).
    deadline_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    #: How much of spent_* has been added to the parent (rolled up at terminal statuses).
    rolled_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    rolled_usd: Mapped[money]
    # --- forks and version stamps (migration 0007) ---
    #: The counterpart this task re-runs: same path of child keys in the tree it came from.
    forked_from: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    #: On a branch's root: the task the fork named and its overrides (payload, agent, model).
    fork: Mapped[jsonb | None]
    #: The model every call of this task uses (a fork's --model), inherited by its subtree.
    model_override: Mapped[str | None] = mapped_column(Text)
    #: An experiment variant's agent swaps (migration 0015): ``{"critic": "critic_v2"}``
    #: runs critic_v2 wherever critic is delegated to; set on a branch's root, inherited.
    agent_map: Mapped[jsonb | None]
    #: The version of the agent that ran the task, and the hash of each prompt it rendered.
    agent_version: Mapped[str | None] = mapped_column(Text)
    prompt_hashes: Mapped[jsonb | None]
    # --- tenants and fair claiming (migration 0008) ---
    #: The label the root was submitted under; the whole tree inherits it.
    tenant: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'default'"))
    #: The claim's order after priority (see runtime.config.SchedulerSettings).
    fair_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                 server_default=text("now()"))

    __table_args__ = (
        CheckConstraint(f"status IN ({_quoted(STATUSES)})", name="status_valid"),
        CheckConstraint("phase IN ('run', 'aggregate')", name="phase_valid"),
        CheckConstraint("status <> 'running' OR lease_token IS NOT NULL", name="running_has_lease"),
        CheckConstraint("depth >= 0", name="depth_not_negative"),
        CheckConstraint(
            "budget_tokens >= 0 AND budget_seconds >= 0 AND budget_usd >= 0",
            name="budgets_not_negative",
        ),
        # The seed's tree index, with the seed's name. Its (status, to_agent, priority)
        # index is gone (migration 0020): each read by status has a partial index below,
        # which a plan on rows without statistics cannot mistake for a cheaper one.
        Index("idx_tasks_root", "root_id"),
        # Claiming reads only claimable rows: millions of finished rows never enter it.
        # Ordered like the claim (priority, fair_at) so a worker serving several
        # agents walks it in order and stops at its LIMIT instead of sorting the queue;
        # to_agent is a filter on that walk.
        Index(
            "ix_tasks_claimable",
            "priority",
            "fair_at",
            "to_agent",
            postgresql_where=text("status IN ('pending', 'ready_to_aggregate')"),
        ),
        # A tenant's running tasks and their leases: [tenants.<name>] max_in_flight.
        Index("ix_tasks_tenant_running", "tenant", "lease_expires_at",
              postgresql_where=text("status = 'running'")),
        Index(
            "ix_tasks_judgeable",
            "priority",
            "created_at",
            postgresql_where=text("status = 'judging' AND lease_token IS NULL"),
        ),
        Index(
            "ix_tasks_leased",
            "lease_expires_at",
            postgresql_where=text("lease_token IS NOT NULL"),
        ),
        Index("ix_tasks_waiting", "id", postgresql_where=text("status = 'waiting'")),
        # What waits for a person (migration 0006): questions to the built-in agent
        # ``human`` and tasks held for approval. The inbox, the question deadline and the
        # doctor read this small index, never the table.
        Index("ix_tasks_inbox", "created_at",
              postgresql_where=text(INBOX_WHERE)),
        # The escalation inbox (migration 0020): escalated tasks only. No index over
        # several statuses: on rows without statistics the planner took one for any of
        # them (the fan-in walked every open task through one, once per parent).
        Index("ix_tasks_escalated", "completed_at", "created_at",
              postgresql_where=text("status = 'escalated'")),
        # The watchdog walks running rows by deadline and stops at the first one not due.
        Index("ix_tasks_running_deadline", "deadline_at",
              postgresql_where=text("status = 'running'")),
        # Fan-in reads children by parent; roots (most rows in a busy queue) stay out of it.
        Index("ix_tasks_parent_id_status", "parent_id", "status",
              postgresql_where=text("parent_id IS NOT NULL")),
        # The branches of a root (roots only: a branch's children are found by tree).
        Index("ix_tasks_forked_from", "forked_from",
              postgresql_where=text("parent_id IS NULL AND forked_from IS NOT NULL")),
        Index(
            "uq_tasks_root_idempotency_key",
            "idempotency_key",
            unique=True,
            postgresql_where=text("parent_id IS NULL AND idempotency_key IS NOT NULL"),
        ),
        Index(
            "uq_tasks_parent_id_idempotency_key",
            "parent_id",
            "idempotency_key",
            unique=True,
            postgresql_where=text("parent_id IS NOT NULL AND idempotency_key IS NOT NULL"),
        ),
    )


class TaskEvent(Base):
    """One transition of one task, written in the same transaction as the transition.

    No foreign key to ``tasks``: every event is inserted by the very statement that
    changes its task, so it cannot point at a missing row, and the per-row FK trigger
    cost about a fifth of the hot path's throughput (measured when it was dropped; the
    run is in the history of docs/performance.md). Pruning
    deletes a tree's events with the tree.
    """

    __tablename__ = "task_events"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    task_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    from_status: Mapped[str | None] = mapped_column(Text)
    to_status: Mapped[str] = mapped_column(Text, nullable=False)
    at: Mapped[dt.datetime] = mapped_column(
        TIMESTAMPTZ, nullable=False, server_default=text("clock_timestamp()")
    )
    worker: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[str | None] = mapped_column(Text)
    #: The delivery (lease token) the transition was written under, when it had one.
    lease_token: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    #: The writing transaction (migration 0017; NULL on older rows): a stream reader reads
    #: events and ``call_text`` gap-free by ``(txid, id)`` below its snapshot's xmin.
    txid: Mapped[int | None] = mapped_column(Xid8(),
                                             server_default=text("pg_current_xact_id()"))

    #: ``(txid, id)``: a tree stream's later reads, from its last read's horizon (0018).
    __table_args__ = (Index("ix_task_events_task_id_id", "task_id", "id"),
                      Index("ix_task_events_txid_id", "txid", "id"))


class WorkerSession(Base):
    """A live worker incarnation, as its lock-holding session registered it (migration 0016).

    The session holds a session-level advisory lock keyed by ``lock_key`` for as long as
    the process lives; PostgreSQL drops the lock when the session ends. A task leased by
    ``owner`` whose row names this server's start time and whose lock is free belongs to
    a dead process and is taken back at once.
    """

    __tablename__ = "worker_sessions"

    owner: Mapped[str] = mapped_column(Text, primary_key=True)
    lock_key: Mapped[int] = mapped_column(Integer, nullable=False)
    server_started_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False)
    backend_pid: Mapped[int] = mapped_column(Integer, nullable=False)
    registered_at: Mapped[dt.datetime] = mapped_column(
        TIMESTAMPTZ, nullable=False, server_default=text("clock_timestamp()")
    )


class ModelCall(Base):
    """One request of a model call made for a task: prompt, response, tokens, cost, duration.

    A call that was retried or repaired has several rows (``attempt_kind``, ``call_try``);
    one served from the record of an earlier delivery has a ``replayed`` row charged zero.
    """

    __tablename__ = "model_calls"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    task_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="CASCADE"), nullable=False
    )
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    call_index: Mapped[int] = mapped_column(Integer, nullable=False)
    backend: Mapped[str] = mapped_column(Text, nullable=False)
    route: Mapped[str] = mapped_column(Text, nullable=False)
    model: Mapped[str] = mapped_column(Text, nullable=False)
    prompt: Mapped[str] = mapped_column(Text, nullable=False)
    response: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    duration_seconds: Mapped[float] = mapped_column(Double, nullable=False, server_default="0")
    cost_usd: Mapped[money]
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(
        TIMESTAMPTZ, nullable=False, server_default=text("now()")
    )
    # Durable calls (migration 0002): the call's identity, the request's kind, the record.
    phase: Mapped[str] = mapped_column(Text, nullable=False, server_default="run")
    position: Mapped[str | None] = mapped_column(Text)
    request_hash: Mapped[str | None] = mapped_column(Text)
    attempt_kind: Mapped[str] = mapped_column(Text, nullable=False, server_default="call")
    call_try: Mapped[int] = mapped_column(Integer, nullable=False, server_default="1")
    replayed: Mapped[bool] = mapped_column(Boolean, nullable=False,
                                           server_default=text("false"))
    thinking: Mapped[str | None] = mapped_column(Text)
    #: The task's tree (migration 0003): a running tree's live spend is summed by root.
    root_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    #: The tool calls the reply asked for (migration 0005), replayed with it.
    tool_calls: Mapped[jsonb | None]

    __table_args__ = (
        Index("ix_model_calls_task_id_attempt", "task_id", "attempt"),
        Index("ix_model_calls_recorded", "task_id", "phase", "position", "request_hash",
              postgresql_where=text("error IS NULL AND NOT replayed")),
        Index("ix_model_calls_root_id", "root_id"),
        CheckConstraint("attempt_kind IN ('call', 'retry', 'repair')", name="attempt_kind"),
    )


#: The writing transaction's id, the default of every ``txid`` column (migration 0017).
CURRENT_XACT_ID = text("pg_current_xact_id()")
_NOW = text("now()")


class CallText(Base):
    """A piece of a model call's output, recorded as it streams (migration 0017).

    Keyed by ``(task_id, phase, call_index, attempt, offset)``: ``offset`` is where
    ``text`` starts in that attempt's output, in characters; a retried or re-delivered
    call writes a new, higher ``attempt``. Written fenced by the delivery's lease token;
    ``txid`` lets a reader walk a tree's pieces by ``(root_id, txid, id)`` with no gap.
    Cascades with its task, so pruning a tree removes its pieces.
    """

    __tablename__ = "call_text"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    root_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    task_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="CASCADE"), nullable=False
    )
    phase: Mapped[str] = mapped_column(Text, nullable=False)
    call_index: Mapped[int] = mapped_column(Integer, nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    offset: Mapped[int] = mapped_column(Integer, nullable=False)
    text: Mapped[str] = mapped_column(Text, nullable=False)
    lease_token: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    txid: Mapped[int] = mapped_column(Xid8(), nullable=False, server_default=CURRENT_XACT_ID)
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                    server_default=_NOW)

    __table_args__ = (
        UniqueConstraint("task_id", "phase", "call_index", "attempt", "offset"),
        Index("ix_call_text_root_id_txid_id", "root_id", "txid", "id"),
    )


class CallReply(Base):
    """A model reply as the recorder process parsed it, journaled before it is charged.

    ``reply`` is the call's ``model_calls`` row as the charge writes it; ``lease_token``
    the delivery that received it. A task that runs again adopts the replies of earlier
    deliveries whose charge never committed (``runtime/store/call_replies.sql``).
    Cascades with its task, so pruning a tree removes its journal (migration 0019).
    """

    __tablename__ = "call_replies"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    task_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="CASCADE"), nullable=False
    )
    lease_token: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    reply: Mapped[Any] = mapped_column(JSONB, nullable=False)
    arrived_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                    server_default=_NOW)

    __table_args__ = (Index("ix_call_replies_task_id", "task_id"),)


class TaskStep(Base):
    """One durable step (``ctx.step``) or tool call of a task: recorded before and after.

    Keyed by ``(task_id, phase, position, name)``; ``starts`` > 1 says it ran again after a
    delivery that died inside it, ``replays`` how often its result was served from here.
    """

    __tablename__ = "task_steps"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    task_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="CASCADE"), nullable=False
    )
    root_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), index=True)
    phase: Mapped[str] = mapped_column(Text, nullable=False)
    position: Mapped[str] = mapped_column(Text, nullable=False)
    name: Mapped[str] = mapped_column(Text, nullable=False)
    kind: Mapped[str] = mapped_column(Text, nullable=False, server_default="step")
    status: Mapped[str] = mapped_column(Text, nullable=False)
    args: Mapped[str | None] = mapped_column(Text)
    args_hash: Mapped[str] = mapped_column(Text, nullable=False)
    idempotency_key: Mapped[str] = mapped_column(Text, nullable=False)
    tool_call_id: Mapped[str | None] = mapped_column(Text)
    result: Mapped[jsonb | None]
    error: Mapped[str | None] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    starts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="1")
    replays: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    tries: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    cost_usd: Mapped[money]
    started_at: Mapped[dt.datetime] = mapped_column(
        TIMESTAMPTZ, nullable=False, server_default=text("clock_timestamp()"))
    finished_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    duration_seconds: Mapped[float | None] = mapped_column(Double)

    __table_args__ = (
        UniqueConstraint("task_id", "phase", "position", "name"),
        CheckConstraint("kind IN ('step', 'tool')", name="kind"),
        CheckConstraint("status IN ('started', 'finished', 'failed')", name="status"),
    )


class ToolApproval(Base):
    """A person's decision on one tool call that ``requires_approval`` (migration 0011).

    Keyed by the task, its phase and the call's id (the step's position); the decision
    holds for that tool with those arguments (``args_hash``, the step's) only.
    """

    __tablename__ = "tool_approvals"

    task_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True)
    phase: Mapped[str] = mapped_column(Text, primary_key=True)
    call_id: Mapped[str] = mapped_column(Text, primary_key=True)
    tool: Mapped[str] = mapped_column(Text, nullable=False)
    args_hash: Mapped[str] = mapped_column(Text, nullable=False)
    args: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text, nullable=False)
    asked_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=text("now()"),
                                                  nullable=False)
    decided_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    decided_by: Mapped[str | None] = mapped_column(Text)
    note: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        CheckConstraint("status IN ('asked', 'approved', 'denied')", name="status"),
    )


class MaintenancePass(Base):
    """When a maintenance pass (reaper, watchdog, sweeper) last ran, across all workers."""

    __tablename__ = "maintenance_passes"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    last_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False)


class ExportCursor(Base):
    """Where an exporter (``traces``) left off: the newest exported ``task_events`` id."""

    __tablename__ = "export_cursors"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    last_event_id: Mapped[int] = mapped_column(BigInteger, nullable=False)
    updated_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=text("now()"),
                                                    nullable=False)


class TreeClock(Base):
    """A tree's fair clock (migration 0009): the fair time of its latest delegated task."""

    __tablename__ = "tree_clocks"

    root_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True)
    clock: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False)
    #: Migration 0012: tokens charged to its calls, how many, and its step's multiple.
    spent: Mapped[float] = mapped_column(Double, nullable=False, server_default="0")
    calls: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    factor: Mapped[float] = mapped_column(Double, nullable=False, server_default="1")


class TenantBucket(Base):
    """A tenant's token bucket (migration 0010; ``[tenants.<name>] tokens_per_minute``)."""

    __tablename__ = "tenant_buckets"

    tenant: Mapped[str] = mapped_column(Text, primary_key=True)
    tokens: Mapped[float] = mapped_column(Double, nullable=False)
    refilled_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=text("now()"),
                                                     nullable=False)


class TreePause(Base):
    """A paused tree (migration 0006): its tasks are not claimed and start no model call.

    One row per paused root; resuming deletes it. Living in the database, a pause
    survives every worker's restart and is seen by every worker at its next claim.
    """

    __tablename__ = "tree_pauses"

    root_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    paused_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                   server_default=text("now()"))
    paused_by: Mapped[str | None] = mapped_column(Text)
    note: Mapped[str | None] = mapped_column(Text)


class WebhookEndpoint(Base):
    """A subscribed webhook endpoint (``[webhooks.<name>]``, or ``orgchart webhooks add``).

    ``events`` are event names (globs expanded when stored); ``secret_env`` names the
    environment variable holding the signing secret, never the secret.
    """

    __tablename__ = "webhook_endpoints"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    url: Mapped[str] = mapped_column(Text, nullable=False)
    events: Mapped[list[str]] = mapped_column(ARRAY(Text), nullable=False)
    tenant: Mapped[str | None] = mapped_column(Text)
    secret_env: Mapped[str] = mapped_column(Text, nullable=False)
    source: Mapped[str] = mapped_column(Text, nullable=False, server_default="cli")
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                    server_default=text("now()"))

    __table_args__ = (CheckConstraint("source IN ('config', 'cli')", name="source"),)


class WebhookOutbox(Base):
    """One event for one endpoint, written by a trigger in the transaction that caused it.

    ``message_id`` is the ``webhook-id`` of every attempt (receivers deduplicate on it);
    ``id`` orders a tree's events. A row is ``pending`` (leased while a deliverer sends
    it), then ``delivered`` or, after ``[webhooks] max_attempts``, ``dead``.
    """

    __tablename__ = "webhook_outbox"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    message_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), nullable=False, unique=True, server_default=text("gen_random_uuid()"))
    endpoint: Mapped[str] = mapped_column(
        Text, ForeignKey("webhook_endpoints.name", ondelete="CASCADE"), nullable=False)
    event: Mapped[str] = mapped_column(Text, nullable=False)
    root_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    task_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    payload: Mapped[Any] = mapped_column(JSONB, nullable=False)
    status: Mapped[str] = mapped_column(Text, nullable=False, server_default="pending")
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                    server_default=text("clock_timestamp()"))
    next_attempt_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                         server_default=text("now()"))
    lease_token: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    delivered_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    last_status: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    #: At most 1 KB of the receiver's answer (never more is stored).
    last_response: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        CheckConstraint("status IN ('pending', 'delivered', 'dead')", name="status"),
        CheckConstraint("octet_length(last_response) <= 1024", name="response_small"),
        Index("ix_webhook_outbox_pending", "next_attempt_at",
              postgresql_where=text("status = 'pending'")),
        Index("ix_webhook_outbox_order", "endpoint", "root_id", "id",
              postgresql_where=text("status = 'pending'")),
        Index("ix_webhook_outbox_dead", "id", postgresql_where=text("status = 'dead'")),
        Index("ix_webhook_outbox_root_id", "root_id"),  # prune: a tree's events go with it
    )


class Fire(Base):
    """One orchestrator fire that ran: its plan, its counts and its rollup note."""

    __tablename__ = "fires"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    started_at: Mapped[dt.datetime] = mapped_column(
        TIMESTAMPTZ, nullable=False, server_default=text("now()")
    )
    finished_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    plan: Mapped[jsonb | None]
    stats: Mapped[jsonb | None]
    rollup: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (Index("ix_fires_started_at", "started_at"),)


# --- experiments (migration 0015; runtime/experiments) ---


class Dataset(Base):
    """A list of cases, stored once per content hash (``version``)."""

    __tablename__ = "datasets"

    id: Mapped[uuid_pk]
    name: Mapped[str] = mapped_column(Text, nullable=False)
    version: Mapped[str] = mapped_column(Text, nullable=False)
    cases: Mapped[int] = mapped_column(Integer, nullable=False)
    source: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                    server_default=text("now()"))

    __table_args__ = (UniqueConstraint("name", "version"),)


class DatasetCase(Base):
    """One case of a dataset: ``goal`` or ``agent`` + ``payload``, ``expected``, criteria."""

    __tablename__ = "dataset_cases"

    dataset_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("datasets.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    body: Mapped[Any] = mapped_column(JSONB, nullable=False)


class Experiment(Base):
    """A dataset run under named variants (the baseline first), with a shared budget."""

    __tablename__ = "experiments"

    id: Mapped[uuid_pk]
    name: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    dataset_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True),
                                                  ForeignKey("datasets.id"), nullable=False)
    variants: Mapped[Any] = mapped_column(JSONB, nullable=False)
    repeat: Mapped[int] = mapped_column(Integer, nullable=False, server_default="1")
    budget_usd: Mapped[Decimal | None] = mapped_column(Numeric(16, 8))
    tenant: Mapped[str] = mapped_column(Text, nullable=False, server_default="default")
    agents_modules: Mapped[Any] = mapped_column(JSONB, nullable=False,
                                                server_default=text("'[]'::jsonb"))
    status: Mapped[str] = mapped_column(Text, nullable=False, server_default="running")
    note: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                    server_default=text("now()"))
    finished_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)

    __table_args__ = (
        CheckConstraint("status IN ('running', 'finished', 'stopped')", name="status_known"),
        CheckConstraint('"repeat" >= 1', name="repeat_positive"),
    )


class ExperimentRun(Base):
    """One tree of an experiment: a case under a variant, one repetition."""

    __tablename__ = "experiment_runs"

    experiment_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    variant: Mapped[str] = mapped_column(Text, primary_key=True)
    repetition: Mapped[int] = mapped_column(Integer, primary_key=True)
    root_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                    server_default=text("now()"))

    __table_args__ = (Index("ix_experiment_runs_root_id", "root_id"),)


class ExperimentScore(Base):
    """One scorer's value for one run, with its explanation."""

    __tablename__ = "experiment_scores"

    experiment_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    variant: Mapped[str] = mapped_column(Text, primary_key=True)
    repetition: Mapped[int] = mapped_column(Integer, primary_key=True)
    scorer: Mapped[str] = mapped_column(Text, primary_key=True)
    value: Mapped[float | None] = mapped_column(Double)
    explanation: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                    server_default=text("now()"))


class Schedule(Base):
    """A schedule (migration 0014): a recurring root goal, or the orchestrator's fire.

    Its cadence is a cron line read in ``timezone`` or ``every_seconds``; ``next_at`` is
    the first slot not handled yet (the ticks read the due ones on ``ix_schedules_due``).
    ``task`` is the root to insert at each slot (a validated ``NewTask``'s fields).
    """

    __tablename__ = "schedules"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    name: Mapped[str] = mapped_column(Text, nullable=False)
    cron: Mapped[str | None] = mapped_column(Text)
    every_seconds: Mapped[float | None] = mapped_column(Double)
    timezone: Mapped[str] = mapped_column(Text, nullable=False, server_default="UTC")
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    task: Mapped[jsonb | None]
    overlap: Mapped[str] = mapped_column(Text, nullable=False, server_default="skip")
    catchup_seconds: Mapped[float] = mapped_column(Double, nullable=False, server_default="60")
    paused: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    next_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                    server_default=text("now()"))
    created_by: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        UniqueConstraint("name"),
        CheckConstraint("kind IN ('goal', 'fire')", name="kind"),
        CheckConstraint("overlap IN ('skip', 'allow', 'cancel_previous')", name="overlap"),
        CheckConstraint("(cron IS NULL) <> (every_seconds IS NULL)", name="cron_or_every"),
        CheckConstraint("(kind = 'goal') = (task IS NOT NULL)", name="goal_has_task"),
        Index("ix_schedules_due", "next_at", postgresql_where=text("NOT paused")),
    )


class ScheduleRun(Base):
    """One slot of a schedule handled (migration 0014): fired, skipped, or a run of missed.

    Unique on ``(schedule_id, slot_at)`` and inserted in the transaction that inserts the
    root (``root_id``) or the ``fires`` row (``fire_id``) the slot starts: a slot fires
    exactly once however many processes tick. ``slots`` counts the slots a ``missed``
    row stands for (from ``slot_at``, outside the catch-up window).
    """

    __tablename__ = "schedule_runs"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    schedule_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("schedules.id", ondelete="CASCADE"), nullable=False)
    slot_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False)
    state: Mapped[str] = mapped_column(Text, nullable=False)
    root_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    fire_id: Mapped[int | None] = mapped_column(BigInteger)
    slots: Mapped[int] = mapped_column(Integer, nullable=False, server_default="1")
    detail: Mapped[str | None] = mapped_column(Text)
    worker: Mapped[str | None] = mapped_column(Text)
    recorded_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, nullable=False,
                                                     server_default=text("now()"))

    __table_args__ = (
        UniqueConstraint("schedule_id", "slot_at"),
        CheckConstraint("state IN ('fired', 'skipped', 'missed')", name="state"),
    )
