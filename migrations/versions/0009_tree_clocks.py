"""Fair time per tree (issue 25): ``tree_clocks``.

One row per tree that has delegated: its *clock*, the fair time handed to its latest
delegated task. A delegation stamps its children ``max(now, clock) + step, + 2 step...``
(step: ``[scheduler] fair_quantum_seconds`` over the tenant's weight) and moves the clock
past them, in the same statement; so a tree's tasks are spaced by the step whatever its
shape (a per-parent spacing multiplied the spacing by the fan-out of each level). The row
goes with its root (``ON DELETE CASCADE``: pruning a tree removes it).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the table."""
    op.create_table(
        "tree_clocks",
        sa.Column("root_id", UUID(as_uuid=True),
                  sa.ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("clock", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    """Drop it."""
    op.drop_table("tree_clocks")
