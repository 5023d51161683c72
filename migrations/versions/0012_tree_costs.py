"""Cost-weighted fair time (issue 25): what each tree's calls cost, on its clock.

``tree_clocks`` gains ``spent`` (tokens its calls were charged) and ``calls`` (how many),
both added by the charge statement (``task_charge_running_many``), and ``factor``: the
multiple of the step its tasks are spaced by, ``max(1, spent / calls /
[scheduler] fair_quantum_tokens)``. A tree whose calls cost ten times the quantum's tokens
has its tasks ten steps apart, so it is claimed a tenth as often. When the charges move
the factor by more than a quarter, the same statement respaces the tree's pending tasks
(and its clock) by the ratio, around now.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the columns (a tree starts at one step per task)."""
    op.add_column("tree_clocks", sa.Column("spent", sa.Double(), nullable=False,
                                           server_default="0"))
    op.add_column("tree_clocks", sa.Column("calls", sa.BigInteger(), nullable=False,
                                           server_default="0"))
    op.add_column("tree_clocks", sa.Column("factor", sa.Double(), nullable=False,
                                           server_default="1"))


def downgrade() -> None:
    """Drop them."""
    op.drop_column("tree_clocks", "factor")
    op.drop_column("tree_clocks", "calls")
    op.drop_column("tree_clocks", "spent")
