"""Approvals of tool calls (issue 26): ``tool_approvals``.

A tool that ``requires_approval`` holds its task until a person decides. The decision is
a row naming exactly that call, not the text of the hold's event: the task, its phase,
the call's id (the step's position, ``<call>#<round>.<index>``), the tool, and the hash
of its validated arguments (the step's ``args_hash``). The tool loop asks (``asked``,
fenced by the task's lease) before it holds the task; ``orgchart approve`` /
``orgchart reject`` decide the task's open asks (``approved`` / ``denied``) in the
transaction that releases or fails the task. A later delivery finds the decision and
does not ask again.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the table."""
    op.create_table(
        "tool_approvals",
        sa.Column("task_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("call_id", sa.Text(), nullable=False),
        sa.Column("tool", sa.Text(), nullable=False),
        sa.Column("args_hash", sa.Text(), nullable=False),
        sa.Column("args", sa.Text(), nullable=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("asked_at", sa.TIMESTAMP(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.Column("decided_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("decided_by", sa.Text(), nullable=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.CheckConstraint("status IN ('asked', 'approved', 'denied')",
                           name="ck_tool_approvals_status"),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"],
                                name="fk_tool_approvals_task_id_tasks", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("task_id", "phase", "call_id", name="pk_tool_approvals"),
    )


def downgrade() -> None:
    """Drop it."""
    op.drop_table("tool_approvals")
