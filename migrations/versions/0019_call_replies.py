"""Durable on arrival (issue 44): a journal of model replies, written before the charge.

- ``call_replies``: one row per model reply as the recorder process parsed it, written
  the moment it arrives with one multi-row INSERT per turn of the recorder's loop and
  committed at once: no task row updated, no tree clock locked (the charge, which does
  both, follows as before). ``reply`` holds the call's ``model_calls`` row as the charge
  would write it (identity, tokens, cost, text); ``lease_token`` is the delivery that
  received it. A task that runs again adopts its earlier deliveries' replies whose charge
  never committed (``runtime/store/call_replies.sql``). Cascades with its task, so
  pruning a tree removes its journal.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.TIMESTAMP(timezone=True)


def upgrade() -> None:
    """Create ``call_replies``."""
    op.create_table(
        "call_replies",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_id", UUID(as_uuid=True), nullable=False),
        sa.Column("lease_token", UUID(as_uuid=True), nullable=False),
        sa.Column("reply", JSONB(), nullable=False),
        sa.Column("arrived_at", _TS, nullable=False, server_default=sa.text("now()")),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], ondelete="CASCADE",
                                name="fk_call_replies_task_id_tasks"),
        sa.PrimaryKeyConstraint("id", name="pk_call_replies"),
    )
    op.create_index("ix_call_replies_task_id", "call_replies", ["task_id"])


def downgrade() -> None:
    """Drop it again."""
    op.drop_table("call_replies")
