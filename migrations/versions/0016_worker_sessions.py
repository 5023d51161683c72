"""Recovery (issue 44): worker sessions PostgreSQL watches; events name their delivery.

- ``worker_sessions``: one row per live worker incarnation (its ``lease_owner``), written
  by the session that holds the incarnation's advisory lock, with the server's start time
  then. A task whose owner's row names this server's start and whose lock nobody holds
  any more belongs to a dead process: it is taken back at once instead of when its lease
  expires. After a restart or a failover the start time differs, and leases decide.
- ``task_events.lease_token``: the delivery (the lease token) a transition was written
  under, so the audit checks fenced writes per delivery, not per worker.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.TIMESTAMP(timezone=True)


def upgrade() -> None:
    """Create ``worker_sessions`` and add ``task_events.lease_token``."""
    op.create_table(
        "worker_sessions",
        sa.Column("owner", sa.Text(), primary_key=True),
        sa.Column("lock_key", sa.Integer(), nullable=False),
        sa.Column("server_started_at", _TS, nullable=False),
        sa.Column("backend_pid", sa.Integer(), nullable=False),
        sa.Column("registered_at", _TS, nullable=False,
                  server_default=sa.text("clock_timestamp()")),
    )
    op.add_column("task_events", sa.Column("lease_token", UUID(as_uuid=True), nullable=True))


def downgrade() -> None:
    """Drop them again."""
    op.drop_column("task_events", "lease_token")
    op.drop_table("worker_sessions")
