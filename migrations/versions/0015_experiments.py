"""Experiments (issue 38): datasets, experiments, their runs and scores; tasks.agent_map.

- ``datasets`` / ``dataset_cases``: a dataset is a list of cases (a goal or an agent and
  payload, optional ``expected``, criteria, tags), stored once per content hash
  (``version``): the same file added twice is one row, an edited file a new version.
- ``experiments``: a dataset run under named variants (``variants``: the baseline and
  each variant's overrides), with its repetitions, budget, tenant and agents modules.
- ``experiment_runs``: one tree per (case, variant, repetition), written in the same
  transaction as the tree's root, so a resumed ``experiment run`` never runs a case twice.
- ``experiment_scores``: one value per run and scorer, with its explanation; a rescore adds
  rows without running anything.
- ``tasks.agent_map``: a variant's agent swaps, set on a branch's root and inherited by
  every task the branch delegates (like ``model_override``).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.TIMESTAMP(timezone=True)


def upgrade() -> None:
    """Create the experiment tables and the column."""
    op.add_column("tasks", sa.Column("agent_map", JSONB(), nullable=True))
    op.create_table(
        "datasets",
        sa.Column("id", UUID(as_uuid=True), primary_key=True,
                  server_default=sa.text("gen_random_uuid()")),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("version", sa.Text(), nullable=False),
        sa.Column("cases", sa.Integer(), nullable=False),
        sa.Column("source", sa.Text()),
        sa.Column("created_at", _TS, nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("id", name="pk_datasets"),
        sa.UniqueConstraint("name", "version", name="uq_datasets_name_version"),
    )
    op.create_table(
        "dataset_cases",
        sa.Column("dataset_id", UUID(as_uuid=True), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("body", JSONB(), nullable=False),
        sa.PrimaryKeyConstraint("dataset_id", "position", name="pk_dataset_cases"),
        sa.ForeignKeyConstraint(["dataset_id"], ["datasets.id"], ondelete="CASCADE",
                                name="fk_dataset_cases_dataset_id_datasets"),
    )
    op.create_table(
        "experiments",
        sa.Column("id", UUID(as_uuid=True), primary_key=True,
                  server_default=sa.text("gen_random_uuid()")),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("dataset_id", UUID(as_uuid=True), nullable=False),
        sa.Column("variants", JSONB(), nullable=False),
        sa.Column("repeat", sa.Integer(), nullable=False, server_default="1"),
        sa.Column("budget_usd", sa.Numeric(16, 8)),
        sa.Column("tenant", sa.Text(), nullable=False, server_default="default"),
        sa.Column("agents_modules", JSONB(), nullable=False,
                  server_default=sa.text("'[]'::jsonb")),
        sa.Column("status", sa.Text(), nullable=False, server_default="running"),
        sa.Column("note", sa.Text()),
        sa.Column("created_at", _TS, nullable=False, server_default=sa.text("now()")),
        sa.Column("finished_at", _TS),
        sa.PrimaryKeyConstraint("id", name="pk_experiments"),
        sa.UniqueConstraint("name", name="uq_experiments_name"),
        sa.ForeignKeyConstraint(["dataset_id"], ["datasets.id"],
                                name="fk_experiments_dataset_id_datasets"),
        sa.CheckConstraint("status IN ('running', 'finished', 'stopped')",
                           name="ck_experiments_status_known"),
        sa.CheckConstraint('"repeat" >= 1', name="ck_experiments_repeat_positive"),
    )
    op.create_table(
        "experiment_runs",
        sa.Column("experiment_id", UUID(as_uuid=True), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("variant", sa.Text(), nullable=False),
        sa.Column("repetition", sa.Integer(), nullable=False),
        sa.Column("root_id", UUID(as_uuid=True), nullable=False),
        sa.Column("created_at", _TS, nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("experiment_id", "position", "variant", "repetition",
                                name="pk_experiment_runs"),
        sa.ForeignKeyConstraint(["experiment_id"], ["experiments.id"], ondelete="CASCADE",
                                name="fk_experiment_runs_experiment_id_experiments"),
    )
    op.create_index("ix_experiment_runs_root_id", "experiment_runs", ["root_id"])
    op.create_table(
        "experiment_scores",
        sa.Column("experiment_id", UUID(as_uuid=True), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("variant", sa.Text(), nullable=False),
        sa.Column("repetition", sa.Integer(), nullable=False),
        sa.Column("scorer", sa.Text(), nullable=False),
        sa.Column("value", sa.Double()),
        sa.Column("explanation", sa.Text()),
        sa.Column("created_at", _TS, nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("experiment_id", "position", "variant", "repetition", "scorer",
                                name="pk_experiment_scores"),
        sa.ForeignKeyConstraint(["experiment_id"], ["experiments.id"], ondelete="CASCADE",
                                name="fk_experiment_scores_experiment_id_experiments"),
    )


def downgrade() -> None:
    """Drop them."""
    op.drop_table("experiment_scores")
    op.drop_index("ix_experiment_runs_root_id", table_name="experiment_runs")
    op.drop_table("experiment_runs")
    op.drop_table("experiments")
    op.drop_table("dataset_cases")
    op.drop_table("datasets")
    op.drop_column("tasks", "agent_map")
