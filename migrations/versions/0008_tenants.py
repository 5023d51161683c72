"""Tenants and fair claiming (issue 25).

- ``tasks.tenant``: the label a root was submitted under (``default`` when none); its
  whole tree inherits it (the delegation statement copies the parent's).
- ``tasks.fair_at``: the task's *fair time*, the claim's order after priority. A root's
  is its submission time; the children one parent delegates are spaced by the tenant's
  quantum after ``max(now, the parent's fair time)``, capped at their creation plus
  ``[scheduler] max_wait_seconds`` (see runtime.config.SchedulerSettings).
- ``ix_tasks_claimable`` is rebuilt on ``(priority, fair_at, to_agent)``: the claim walks
  it in order and stops at its LIMIT, as before.
- ``ix_tasks_tenant_running``: the running tasks of one tenant with their lease expiry,
  what the claim counts for ``[tenants.<name>] max_in_flight`` (live leases only, so a
  SIGKILLed worker's tasks stop counting when their leases expire).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_CLAIMABLE = "status IN ('pending', 'ready_to_aggregate')"


def upgrade() -> None:
    """Add the columns (existing tasks: tenant 'default', fair time = creation) and indexes."""
    op.add_column("tasks", sa.Column("tenant", sa.Text(), nullable=False,
                                     server_default=sa.text("'default'")))
    op.add_column("tasks", sa.Column("fair_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE tasks SET fair_at = created_at")
    op.alter_column("tasks", "fair_at", nullable=False, server_default=sa.text("now()"))
    op.drop_index("ix_tasks_claimable", table_name="tasks")
    op.create_index("ix_tasks_claimable", "tasks", ["priority", "fair_at", "to_agent"],
                    postgresql_where=sa.text(_CLAIMABLE))
    op.create_index("ix_tasks_tenant_running", "tasks", ["tenant", "lease_expires_at"],
                    postgresql_where=sa.text("status = 'running'"))


def downgrade() -> None:
    """Put the claim's index back on created_at and drop the columns."""
    op.drop_index("ix_tasks_tenant_running", table_name="tasks")
    op.drop_index("ix_tasks_claimable", table_name="tasks")
    op.create_index("ix_tasks_claimable", "tasks", ["priority", "created_at", "to_agent"],
                    postgresql_where=sa.text(_CLAIMABLE))
    op.drop_column("tasks", "fair_at")
    op.drop_column("tasks", "tenant")
