"""Durable steps and tool calls: ``task_steps``, and the tool calls a model reply asked for.

- ``task_steps``: one row per durable step of a task (``ctx.step``) or tool call of a
  model's tool loop, keyed by ``(task_id, phase, position, name)``. A step is recorded
  ``started`` before its function runs and ``finished`` (with its JSON result) or
  ``failed`` (with its error) after; a redelivered task that reaches a ``finished`` step
  with the same arguments gets its result without running it (``replays`` counts those).
  A step found ``started`` (its worker died inside it) runs again: ``starts`` says how
  often it started. Both writes are fenced by the task's lease token (in the SQL).
- ``model_calls.tool_calls``: the tool calls a reply asked for (Ollama's
  ``message.tool_calls``), so a replayed reply asks for the same tools again.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``task_steps`` and ``model_calls.tool_calls``."""
    op.create_table(
        "task_steps",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("root_id", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("position", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), server_default="step", nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("args", sa.Text(), nullable=True),
        sa.Column("args_hash", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("tool_call_id", sa.Text(), nullable=True),
        sa.Column("result", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("starts", sa.Integer(), server_default="1", nullable=False),
        sa.Column("replays", sa.Integer(), server_default="0", nullable=False),
        sa.Column("tries", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cost_usd", sa.Numeric(16, 8), server_default="0", nullable=False),
        sa.Column("started_at", sa.TIMESTAMP(timezone=True),
                  server_default=sa.text("clock_timestamp()"), nullable=False),
        sa.Column("finished_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("duration_seconds", sa.Double(), nullable=True),
        sa.CheckConstraint("kind IN ('step', 'tool')", name="ck_task_steps_kind"),
        sa.CheckConstraint("status IN ('started', 'finished', 'failed')",
                           name="ck_task_steps_status"),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], name="fk_task_steps_task_id_tasks",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_task_steps"),
        sa.UniqueConstraint("task_id", "phase", "position", "name",
                            name="uq_task_steps_task_id_phase_position_name"),
    )
    op.create_index("ix_task_steps_root_id", "task_steps", ["root_id"])
    op.add_column("model_calls", sa.Column("tool_calls", postgresql.JSONB(astext_type=sa.Text()),
                                           nullable=True))


def downgrade() -> None:
    """Drop what :func:`upgrade` added."""
    op.drop_column("model_calls", "tool_calls")
    op.drop_index("ix_task_steps_root_id", table_name="task_steps")
    op.drop_table("task_steps")
