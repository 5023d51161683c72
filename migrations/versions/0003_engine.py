"""The engine's columns: an indexed watchdog deadline, spend rolled up at fan-in, calls by root.

- ``tasks.deadline_at``: set at claim to ``now() + budget_seconds``; the watchdog reads it
  through a partial index on running rows instead of computing ``claimed_at + interval``
  for every running row.
- ``tasks.rolled_tokens`` / ``tasks.rolled_usd``: how much of a child's ``spent_*`` has
  been added to its parent. A model call charges only its own task; the spend rolls up
  when the child reaches a terminal status (the difference since the last roll-up, so a
  child retried by its parent is never counted twice).
- ``model_calls.root_id`` (indexed): the live spend of a running tree is summed from its
  calls, not from a hot root row.
- ``maintenance_passes``: when each maintenance pass last ran, so that the reaper, the
  watchdog and the sweeper run once per interval across all workers.

Revision ID: 0003
Revises: 0001 (the lead re-points this to 0002 when the branches merge)
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.TIMESTAMP(timezone=True)


def upgrade() -> None:
    """Add the columns, backfill them, and index them."""
    op.add_column("tasks", sa.Column("deadline_at", TS, nullable=True))
    op.add_column("tasks", sa.Column("rolled_tokens", sa.BigInteger(), server_default="0",
                                     nullable=False))
    op.add_column("tasks", sa.Column("rolled_usd", sa.Numeric(16, 8), server_default="0",
                                     nullable=False))
    # Before this revision every charge was rolled up to the root at once: all spend
    # recorded so far is already in the ancestors.
    op.execute("UPDATE tasks SET rolled_tokens = spent_tokens, rolled_usd = spent_usd "
               "WHERE parent_id IS NOT NULL")
    op.execute("UPDATE tasks SET deadline_at = claimed_at "
               "+ make_interval(secs => COALESCE(budget_seconds, 300)) "
               "WHERE status = 'running'")
    op.create_index("ix_tasks_running_deadline", "tasks", ["deadline_at"],
                    postgresql_where=sa.text("status = 'running'"))

    op.add_column("model_calls", sa.Column("root_id", pg.UUID(as_uuid=True), nullable=True))
    op.execute("UPDATE model_calls m SET root_id = t.root_id FROM tasks t WHERE t.id = m.task_id")
    op.create_index("ix_model_calls_root_id", "model_calls", ["root_id"])

    op.create_table(
        "maintenance_passes",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("last_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_maintenance_passes"),
    )


def downgrade() -> None:
    """Drop what the upgrade added."""
    op.drop_table("maintenance_passes")
    op.drop_index("ix_model_calls_root_id", table_name="model_calls")
    op.drop_column("model_calls", "root_id")
    op.drop_index("ix_tasks_running_deadline", table_name="tasks")
    op.drop_column("tasks", "rolled_usd")
    op.drop_column("tasks", "rolled_tokens")
    op.drop_column("tasks", "deadline_at")
