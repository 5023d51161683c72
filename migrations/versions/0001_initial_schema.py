"""Initial schema: tasks (the seed's columns plus the runtime's), task_events, model_calls, fires.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.TIMESTAMP(timezone=True)
STATUSES = (
    "'pending', 'running', 'waiting', 'ready_to_aggregate', 'judging', 'done', 'failed', "
    "'escalated'"
)


def upgrade() -> None:
    """Create the four tables and their indexes."""
    # gen_random_uuid() is built in from PostgreSQL 13 on; 15 and 18 are supported.
    op.create_table(
        "tasks",
        # The seed's twenty columns (seed 003), exactly.
        sa.Column("id", pg.UUID(as_uuid=True), server_default=sa.text("gen_random_uuid()"),
                  nullable=False),
        sa.Column("parent_id", pg.UUID(as_uuid=True), nullable=True),
        sa.Column("root_id", pg.UUID(as_uuid=True), nullable=True),
        sa.Column("from_agent", sa.Text(), nullable=True),
        sa.Column("to_agent", sa.Text(), nullable=False),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("hypothesis_id", pg.UUID(as_uuid=True), nullable=True),
        sa.Column("payload", pg.JSONB(), nullable=False),
        sa.Column("success_criteria", pg.JSONB(), nullable=True),
        sa.Column("kill_criteria", pg.JSONB(), nullable=True),
        sa.Column("budget_tokens", sa.Integer(), server_default="50000", nullable=True),
        sa.Column("budget_seconds", sa.Integer(), server_default="300", nullable=True),
        sa.Column("budget_usd", sa.Numeric(10, 4), server_default="1.0", nullable=True),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("priority", sa.Integer(), server_default="5", nullable=True),
        sa.Column("created_at", TS, server_default=sa.text("now()"), nullable=True),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("completed_at", TS, nullable=True),
        sa.Column("result", pg.JSONB(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        # The runtime's columns.
        sa.Column("depth", sa.Integer(), server_default="0", nullable=False),
        sa.Column("phase", sa.Text(), server_default="run", nullable=False),
        sa.Column("available_at", TS, server_default=sa.text("now()"), nullable=False),
        sa.Column("lease_owner", sa.Text(), nullable=True),
        sa.Column("lease_token", pg.UUID(as_uuid=True), nullable=True),
        sa.Column("lease_expires_at", TS, nullable=True),
        sa.Column("claimed_at", TS, nullable=True),
        sa.Column("delivery_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("retry_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("request_hash", sa.Text(), nullable=True),
        sa.Column("own_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("own_usd", sa.Numeric(16, 8), server_default="0", nullable=False),
        sa.Column("spent_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("spent_usd", sa.Numeric(16, 8), server_default="0", nullable=False),
        sa.Column("duration_seconds", sa.Double(), server_default="0", nullable=False),
        sa.Column("route", sa.Text(), nullable=True),
        sa.Column("route_reason", sa.Text(), nullable=True),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("verdict", pg.JSONB(), nullable=True),
        sa.Column("updated_at", TS, server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_tasks"),
        sa.ForeignKeyConstraint(["parent_id"], ["tasks.id"], name="fk_tasks_parent_id_tasks"),
        sa.CheckConstraint(f"status IN ({STATUSES})", name="ck_tasks_status_valid"),
        sa.CheckConstraint("phase IN ('run', 'aggregate')", name="ck_tasks_phase_valid"),
        sa.CheckConstraint(
            "status <> 'running' OR lease_token IS NOT NULL", name="ck_tasks_running_has_lease"
        ),
        sa.CheckConstraint("depth >= 0", name="ck_tasks_depth_not_negative"),
        sa.CheckConstraint(
            "budget_tokens >= 0 AND budget_seconds >= 0 AND budget_usd >= 0",
            name="ck_tasks_budgets_not_negative",
        ),
    )
    # The seed's indexes, with the seed's names.
    op.create_index("idx_tasks_status_agent", "tasks", ["status", "to_agent", "priority"])
    op.create_index("idx_tasks_root", "tasks", ["root_id"])
    # Claiming reads only claimable rows, so finished rows never slow it down; ordered
    # like the claim so a worker serving several agents stops at its LIMIT.
    op.create_index(
        "ix_tasks_claimable", "tasks", ["priority", "created_at", "to_agent"],
        postgresql_where=sa.text("status IN ('pending', 'ready_to_aggregate')"),
    )
    op.create_index(
        "ix_tasks_judgeable", "tasks", ["priority", "created_at"],
        postgresql_where=sa.text("status = 'judging' AND lease_token IS NULL"),
    )
    op.create_index(
        "ix_tasks_leased", "tasks", ["lease_expires_at"],
        postgresql_where=sa.text("lease_token IS NOT NULL"),
    )
    op.create_index("ix_tasks_waiting", "tasks", ["id"],
                    postgresql_where=sa.text("status = 'waiting'"))
    # Fan-in reads children by parent; roots stay out of this index.
    op.create_index("ix_tasks_parent_id_status", "tasks", ["parent_id", "status"],
                    postgresql_where=sa.text("parent_id IS NOT NULL"))
    op.create_index(
        "uq_tasks_root_idempotency_key", "tasks", ["idempotency_key"], unique=True,
        postgresql_where=sa.text("parent_id IS NULL AND idempotency_key IS NOT NULL"),
    )
    op.create_index(
        "uq_tasks_parent_id_idempotency_key", "tasks", ["parent_id", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text("parent_id IS NOT NULL AND idempotency_key IS NOT NULL"),
    )

    op.create_table(
        "task_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("from_status", sa.Text(), nullable=True),
        sa.Column("to_status", sa.Text(), nullable=False),
        sa.Column("at", TS, server_default=sa.text("clock_timestamp()"), nullable=False),
        sa.Column("worker", sa.Text(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_task_events"),
        # No FK to tasks: each event is written by the statement that changes its task,
        # and the per-row FK check was a fifth of the hot path (see runtime/store/models.py).
    )
    op.create_index("ix_task_events_task_id_id", "task_events", ["task_id", "id"])

    op.create_table(
        "model_calls",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("call_index", sa.Integer(), nullable=False),
        sa.Column("backend", sa.Text(), nullable=False),
        sa.Column("route", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("response", sa.Text(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("completion_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("duration_seconds", sa.Double(), server_default="0", nullable=False),
        sa.Column("cost_usd", sa.Numeric(16, 8), server_default="0", nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TS, server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_model_calls"),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], ondelete="CASCADE",
                                name="fk_model_calls_task_id_tasks"),
    )
    op.create_index("ix_model_calls_task_id_attempt", "model_calls", ["task_id", "attempt"])

    op.create_table(
        "fires",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("started_at", TS, server_default=sa.text("now()"), nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("plan", pg.JSONB(), nullable=True),
        sa.Column("stats", pg.JSONB(), nullable=True),
        sa.Column("rollup", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_fires"),
    )
    op.create_index("ix_fires_started_at", "fires", ["started_at"])


def downgrade() -> None:
    """Drop everything the upgrade created."""
    op.drop_table("fires")
    op.drop_table("model_calls")
    op.drop_table("task_events")
    op.drop_table("tasks")
