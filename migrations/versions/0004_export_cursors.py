"""Where each exporter left off: a trace exporter that restarts resumes, losing no span.

- ``export_cursors``: one row per exporter (``traces``): the newest ``task_events`` id
  whose task has been exported. The process that holds the exporter's lock advances it
  after each batch is sent; a process that takes over (or restarts) reads it and goes
  on from there, so a tree that ended while no exporter ran is still sent (at least
  once: a batch sent just before a crash may be sent again, with the same span ids).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the table."""
    op.create_table(
        "export_cursors",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("last_event_id", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.TIMESTAMP(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_export_cursors"),
    )


def downgrade() -> None:
    """Drop it."""
    op.drop_table("export_cursors")
