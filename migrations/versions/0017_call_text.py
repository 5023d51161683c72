"""Streaming (issue 47): a model call's text, recorded in pieces as it streams.

- ``call_text``: one row per piece of a call's output, keyed by
  ``(task_id, phase, call_index, attempt, "offset")`` so no piece is stored twice; a
  retried or re-delivered call writes a new, higher ``attempt``. ``lease_token`` is the
  delivery that wrote it (writes are fenced by it). ``txid`` is the writing
  transaction's id, so a reader walks a tree's pieces by ``(root_id, txid, id)`` and
  never skips a row a transaction still open will commit below what it has read.
- ``task_events.txid``: the same for transitions, so a reader merges both tables
  gap-free by ``(txid, id)`` below its snapshot's xmin. Nullable with a default: old rows
  stay NULL and the table is not rewritten.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.TIMESTAMP(timezone=True)


class _Xid8(sa.types.UserDefinedType[int]):
    """PostgreSQL's 64-bit transaction id (``xid8``, PostgreSQL 13+)."""

    cache_ok = True

    def get_col_spec(self, **kw: object) -> str:
        """Return the column's SQL type."""
        return "xid8"


def upgrade() -> None:
    """Create ``call_text`` and add ``task_events.txid``."""
    op.create_table(
        "call_text",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("root_id", UUID(as_uuid=True), nullable=False),
        sa.Column("task_id", UUID(as_uuid=True), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("call_index", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("offset", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("lease_token", UUID(as_uuid=True), nullable=True),
        sa.Column("txid", _Xid8(), nullable=False,
                  server_default=sa.text("pg_current_xact_id()")),
        sa.Column("created_at", _TS, nullable=False, server_default=sa.text("now()")),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], ondelete="CASCADE",
                                name="fk_call_text_task_id_tasks"),
        sa.PrimaryKeyConstraint("id", name="pk_call_text"),
        sa.UniqueConstraint("task_id", "phase", "call_index", "attempt", "offset",
                            name="uq_call_text_task_id_phase_call_index_attempt_offset"),
    )
    op.create_index("ix_call_text_root_id_txid_id", "call_text", ["root_id", "txid", "id"])
    op.execute("ALTER TABLE task_events ADD COLUMN txid xid8")
    op.execute("ALTER TABLE task_events ALTER COLUMN txid SET DEFAULT pg_current_xact_id()")


def downgrade() -> None:
    """Drop them again."""
    op.execute("ALTER TABLE task_events DROP COLUMN txid")
    op.drop_table("call_text")
