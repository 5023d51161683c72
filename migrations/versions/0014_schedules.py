"""Schedules in the database (issue 39): ``schedules`` and ``schedule_runs``.

A schedule is a recurring root goal, or the orchestrator's fire, on a cron line (in a
time zone) or every N seconds. ``next_at`` is its first slot not handled yet: every
worker, ``serve`` and ``fire`` process reads the due ones on ``ix_schedules_due`` and
handles a schedule under its row lock. ``schedule_runs`` holds one row per slot handled
(fired, skipped by the overlap policy, or a run of missed slots), unique on
``(schedule_id, slot_at)``: a slot's row is inserted in the transaction that inserts the
root (or the ``fires`` row) it starts, so a slot fires exactly once across any number
of processes and hosts.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the two tables and their indexes."""
    op.create_table(
        "schedules",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("cron", sa.Text()),
        sa.Column("every_seconds", sa.Double()),
        sa.Column("timezone", sa.Text(), nullable=False, server_default="UTC"),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("task", JSONB()),
        sa.Column("overlap", sa.Text(), nullable=False, server_default="skip"),
        sa.Column("catchup_seconds", sa.Double(), nullable=False, server_default="60"),
        sa.Column("paused", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("next_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.text("now()")),
        sa.Column("created_by", sa.Text()),
        sa.CheckConstraint("kind IN ('goal', 'fire')", name="ck_schedules_kind"),
        sa.CheckConstraint("overlap IN ('skip', 'allow', 'cancel_previous')",
                           name="ck_schedules_overlap"),
        sa.CheckConstraint("(cron IS NULL) <> (every_seconds IS NULL)",
                           name="ck_schedules_cron_or_every"),
        sa.CheckConstraint("(kind = 'goal') = (task IS NOT NULL)",
                           name="ck_schedules_goal_has_task"),
        sa.UniqueConstraint("name", name="uq_schedules_name"),
    )
    op.create_index("ix_schedules_due", "schedules", ["next_at"],
                    postgresql_where=sa.text("NOT paused"))
    op.create_table(
        "schedule_runs",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column("schedule_id", sa.BigInteger(),
                  sa.ForeignKey("schedules.id", ondelete="CASCADE",
                                name="fk_schedule_runs_schedule_id_schedules"),
                  nullable=False),
        sa.Column("slot_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("root_id", UUID(as_uuid=True)),
        sa.Column("fire_id", sa.BigInteger()),
        sa.Column("slots", sa.Integer(), nullable=False, server_default="1"),
        sa.Column("detail", sa.Text()),
        sa.Column("worker", sa.Text()),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.text("now()")),
        sa.CheckConstraint("state IN ('fired', 'skipped', 'missed')",
                           name="ck_schedule_runs_state"),
        sa.UniqueConstraint("schedule_id", "slot_at",
                            name="uq_schedule_runs_schedule_id_slot_at"),
    )


def downgrade() -> None:
    """Drop them."""
    op.drop_table("schedule_runs")
    op.drop_index("ix_schedules_due", table_name="schedules")
    op.drop_table("schedules")
