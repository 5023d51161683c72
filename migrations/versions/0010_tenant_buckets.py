"""Token buckets per tenant (issue 25): ``tenant_buckets``.

One row per tenant with ``[tenants.<name>] tokens_per_minute``, made by its first model
call: the tokens the bucket holds now (``tokens``, fractional: it refills continuously;
negative when calls spent more than they reserved) as of ``refilled_at``. It is refilled
lazily, by the statement that takes from it (``tenant_bucket_take``), at the rate times
the time elapsed, and never holds more than one minute's worth: a reservation a dead
worker never settled is simply spent, and the bucket fills up again by itself.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the table."""
    op.create_table(
        "tenant_buckets",
        sa.Column("tenant", sa.Text(), primary_key=True),
        sa.Column("tokens", sa.Double(), nullable=False),
        sa.Column("refilled_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.text("now()")),
    )


def downgrade() -> None:
    """Drop it."""
    op.drop_table("tenant_buckets")
