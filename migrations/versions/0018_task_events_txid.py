"""Streaming (issue 47): an index on ``task_events (txid, id)`` for a tree stream's reads.

A tree stream (``stream_read``) that has read everything below some snapshot's xmin reads
next only the transitions of the transactions since then, in ``(txid, id)`` order, and
keeps those of its tree's tasks: on this index that costs what was written since, not the
tree's size (a caught-up read of a 931-task tree among 1.96 million events: 9.9-11.5 ms
and 9,352 buffers on ``(task_id, id)`` per task, 0.3-0.7 ms and 8 buffers on this one).
The price: one more index entry per transition (about 75 bytes of WAL each, measured on
bulk inserts: 371 against 296 bytes per event). Rows older than migration 0017 (txid
NULL) are in it too, and never read through it.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create ``ix_task_events_txid_id``."""
    op.create_index("ix_task_events_txid_id", "task_events", ["txid", "id"])


def downgrade() -> None:
    """Drop it again."""
    op.drop_index("ix_task_events_txid_id", table_name="task_events")
