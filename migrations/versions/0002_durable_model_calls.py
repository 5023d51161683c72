"""Durable model calls: each model_calls row knows its call's identity and kind.

Adds to ``model_calls``: ``phase`` and ``position`` (where the call stands in its task),
``request_hash`` (sha256 of model, messages, schema and options), ``attempt_kind``
(``call``, ``retry`` after a transient error, ``repair`` after a bad reply), ``call_try``
(the request's number within its call), ``replayed`` (served from the record, charged
zero) and ``thinking`` (a thinking model's reasoning, kept apart from the answer); and a
partial index to find a call's recorded successful reply. The index is not unique: with
``[llm] record = false`` or ``durable = false`` every delivery records its own successful
row for the same identity, and the lookup takes the latest.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RECORDED_INDEX = "ix_model_calls_recorded"


def upgrade() -> None:
    """Add the identity, kind, replay and thinking columns and the record's index."""
    op.add_column("model_calls", sa.Column("phase", sa.Text(), server_default="run",
                                           nullable=False))
    op.add_column("model_calls", sa.Column("position", sa.Text(), nullable=True))
    op.add_column("model_calls", sa.Column("request_hash", sa.Text(), nullable=True))
    op.add_column("model_calls", sa.Column("attempt_kind", sa.Text(), server_default="call",
                                           nullable=False))
    op.add_column("model_calls", sa.Column("call_try", sa.Integer(), server_default="1",
                                           nullable=False))
    op.add_column("model_calls", sa.Column("replayed", sa.Boolean(),
                                           server_default=sa.text("false"), nullable=False))
    op.add_column("model_calls", sa.Column("thinking", sa.Text(), nullable=True))
    op.create_check_constraint(
        "ck_model_calls_attempt_kind", "model_calls",
        "attempt_kind IN ('call', 'retry', 'repair')")
    op.create_index(
        RECORDED_INDEX, "model_calls", ["task_id", "phase", "position", "request_hash"],
        postgresql_where=sa.text("error IS NULL AND NOT replayed"))


def downgrade() -> None:
    """Drop what :func:`upgrade` added."""
    op.drop_index(RECORDED_INDEX, table_name="model_calls")
    op.drop_constraint("ck_model_calls_attempt_kind", "model_calls", type_="check")
    for column in ("thinking", "replayed", "call_try", "attempt_kind", "request_hash",
                   "position", "phase"):
        op.drop_column("model_calls", column)
