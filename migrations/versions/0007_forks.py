"""Forks and version stamps: a branch re-runs a tree and replays the calls that did not change.

- ``tasks.forked_from``: the task of another tree this one re-runs (its *counterpart*:
  the task at the same path of child keys from the root). Set on a branch's root at
  fork time and on each branch child whose counterpart exists, by the delegation
  statement that inserts it. No foreign key: the original may be pruned first.
- ``tasks.fork``: on a branch's root only, what the fork changes and where (the
  original task named, and its payload, agent and model overrides, and a note).
- ``tasks.model_override``: the model every call of this task uses (a fork's
  ``--model``), inherited by the task's subtree.
- ``tasks.agent_version`` and ``tasks.prompt_hashes``: the version of the agent that ran
  the task and the hash of each prompt it rendered (what a re-run may have changed).
- ``ix_tasks_forked_from``: the branches of a root (roots only).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the columns (all nullable: no table rewrite) and the roots' index."""
    op.add_column("tasks", sa.Column("forked_from", UUID(as_uuid=True), nullable=True))
    op.add_column("tasks", sa.Column("fork", JSONB(), nullable=True))
    op.add_column("tasks", sa.Column("model_override", sa.Text(), nullable=True))
    op.add_column("tasks", sa.Column("agent_version", sa.Text(), nullable=True))
    op.add_column("tasks", sa.Column("prompt_hashes", JSONB(), nullable=True))
    op.create_index("ix_tasks_forked_from", "tasks", ["forked_from"],
                    postgresql_where=sa.text("parent_id IS NULL AND forked_from IS NOT NULL"))


def downgrade() -> None:
    """Drop them."""
    op.drop_index("ix_tasks_forked_from", table_name="tasks")
    for column in ("prompt_hashes", "agent_version", "model_override", "fork", "forked_from"):
        op.drop_column("tasks", column)
