"""Plans that keep their shape without statistics: drop ``idx_tasks_status_agent`` (issue 44).

- ``idx_tasks_status_agent`` (status, to_agent, priority), the seed's index: every statement
  that reads tasks by status has a partial index of its own (``ix_tasks_claimable``,
  ``ix_tasks_waiting``, ``ix_tasks_running_deadline``, ``ix_tasks_tenant_running``,
  ``ix_tasks_judgeable``, ``ix_tasks_inbox``, ``ix_tasks_leased``). On rows PostgreSQL
  had no statistics for (a fresh database, a new tree in a big analysed table), the planner
  took a status equality for about one row and read this index instead: the fan-in and the
  sweeper found waiting parents through it, the roll-up filtered hundreds of its entries
  by id, and every status change wrote an entry in it (finished rows, most of a big
  table, included). ``metrics_live_tasks`` now reads each live status through its own
  partial index.
- ``ix_tasks_escalated`` (completed_at, created_at) where status = 'escalated': the
  escalation inbox (``task_list_escalated``, ``task_list_inbox``), the one listing left
  without a partial index. An index over several statuses (all open tasks, say) would be
  the planner's pick for any of them on rows without statistics: the fan-in's probe of a
  parent's children walked every open task through one, once per parent.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Drop the seed's status index; index the escalated tasks alone."""
    op.drop_index("idx_tasks_status_agent", table_name="tasks")
    op.create_index("ix_tasks_escalated", "tasks", ["completed_at", "created_at"],
                    postgresql_where=sa.text("status = 'escalated'"))


def downgrade() -> None:
    """Put the seed's status index back; drop the escalated one."""
    op.drop_index("ix_tasks_escalated", table_name="tasks")
    op.create_index("idx_tasks_status_agent", "tasks", ["status", "to_agent", "priority"])
