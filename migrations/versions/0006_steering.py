"""Steering a running tree: cancelled and awaiting_approval statuses, paused trees, the inbox.

- ``tasks.status`` may be ``cancelled`` (terminal: ``orgchart cancel`` ends a task and its
  open subtree; fan-in counts it as a failed child) and ``awaiting_approval`` (the
  ``require_approval`` policy holds the task until a person approves or rejects it).
- ``tree_pauses``: one row per paused root (``orgchart pause``); claims skip its tree's
  tasks and its running tasks start no model call until ``orgchart resume`` deletes it.
- ``ix_tasks_inbox``: a partial index over what waits for a person (questions to the
  built-in agent ``human`` and tasks awaiting approval), read by the inbox, the question
  deadline and the doctor.

Downgrade: a cancelled task becomes ``failed`` (error kept, or "cancelled"), a task
awaiting approval becomes ``escalated`` (it still waits for a person), pauses are lost.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATUSES = ("pending", "running", "waiting", "ready_to_aggregate", "judging", "done",
                "failed", "escalated")
NEW_STATUSES = (*OLD_STATUSES, "cancelled", "awaiting_approval")
INBOX_WHERE = "status = 'awaiting_approval' OR (status = 'pending' AND to_agent = 'human')"


def _check(statuses: tuple[str, ...]) -> str:
    return "status IN (" + ", ".join(f"'{s}'" for s in statuses) + ")"


def upgrade() -> None:
    """Widen the status CHECK, add the pause table and the inbox index."""
    op.drop_constraint("ck_tasks_status_valid", "tasks", type_="check")
    op.create_check_constraint("ck_tasks_status_valid", "tasks", _check(NEW_STATUSES))
    op.create_table(
        "tree_pauses",
        sa.Column("root_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("paused_at", sa.TIMESTAMP(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.Column("paused_by", sa.Text(), nullable=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("root_id", name="pk_tree_pauses"),
    )
    op.create_index("ix_tasks_inbox", "tasks", ["created_at"],
                    postgresql_where=sa.text(INBOX_WHERE))


def downgrade() -> None:
    """Map the new statuses onto old ones, then narrow the CHECK and drop what was added."""
    op.drop_index("ix_tasks_inbox", table_name="tasks")
    op.drop_table("tree_pauses")
    op.execute("UPDATE tasks SET status = 'failed', error = COALESCE(error, 'cancelled') "
               "WHERE status = 'cancelled'")
    op.execute("UPDATE tasks SET status = 'escalated', "
               "error = COALESCE(error, 'awaiting approval (downgraded)') "
               "WHERE status = 'awaiting_approval'")
    op.drop_constraint("ck_tasks_status_valid", "tasks", type_="check")
    op.create_check_constraint("ck_tasks_status_valid", "tasks", _check(OLD_STATUSES))
