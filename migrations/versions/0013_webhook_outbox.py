"""Webhooks: the endpoints, the outbox and the trigger that fills it (issue 39).

``webhook_endpoints`` holds the subscribed endpoints (``[webhooks.<name>]`` of the
configuration, copied in when a worker or ``serve`` starts, and ``orgchart webhooks
add``). ``webhook_outbox`` holds one row per event per endpoint, written in the
transaction of the state change it reports: the statement-level trigger
``webhook_outbox_from_events`` reads the ``task_events`` rows a statement inserted (a
transition table) and, only when some endpoint exists, inserts the matching events. So
no statement of ``queries.sql`` changes for it, a rolled-back change leaves no row, and
with no endpoint the cost is one probe of an empty table per statement. A row per
endpoint (not one per event fanned out at delivery) keeps each endpoint's attempts,
backoff, lease and dead letter on its own row: one slow receiver never holds back
another's, and ordering is per endpoint and tree.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The trigger's function: task_events rows -> outbox rows for the subscribed endpoints.
#: One event may report several things (a root escalated: ``task.escalated`` and
#: ``tree.finished``); a cancelled subtree reports its top only (``task.cancelled``).
#: It notifies ``orgchart_webhooks``: ``runtime.store.queries.WEBHOOKS_CHANNEL`` at this
#: revision (a revision never imports the code it outlives).
_FUNCTION = """
CREATE FUNCTION webhook_outbox_from_events() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Nothing subscribed (the usual case): one probe of an empty table, nothing else.
    IF NOT EXISTS (SELECT 1 FROM webhook_endpoints) THEN
        RETURN NULL;
    END IF;
    INSERT INTO webhook_outbox (endpoint, event, root_id, task_id, payload)
    SELECT w.name, m.event, COALESCE(t.root_id, t.id), t.id,
           jsonb_build_object(
               'event', m.event, 'task_id', t.id, 'root_id', COALESCE(t.root_id, t.id),
               'tenant', t.tenant, 'agent', t.to_agent, 'status', t.status,
               'at', e.at, 'detail', e.detail) ||
           CASE WHEN m.event = 'tree.finished' THEN jsonb_build_object(
                    'goal', t.payload, 'result', t.result, 'error', t.error,
                    'spent_usd', t.spent_usd::text, 'spent_tokens', t.spent_tokens)
                WHEN m.event = 'task.question' THEN jsonb_build_object(
                    'question', COALESCE(t.payload->'question', t.payload),
                    'answer_schema', t.payload->'answer_schema',
                    'choices', t.payload->'choices', 'asked_by', t.from_agent)
                ELSE jsonb_build_object('payload', t.payload, 'error', t.error) END
    FROM new_events e
    JOIN tasks t ON t.id = e.task_id
    CROSS JOIN LATERAL (VALUES
        (1, 'task.question',
         e.from_status IS NULL AND e.to_status = 'pending' AND t.to_agent = 'human'),
        (2, 'task.awaiting_approval', e.to_status = 'awaiting_approval'),
        (3, 'task.escalated', e.to_status = 'escalated'),
        (4, 'task.cancelled', e.to_status = 'cancelled' AND NOT EXISTS (
             SELECT 1 FROM new_events p
             WHERE p.task_id = t.parent_id AND p.to_status = 'cancelled')),
        (5, 'tree.finished', t.parent_id IS NULL
             AND e.to_status IN ('done', 'failed', 'escalated', 'cancelled'))
    ) AS m(ord, event, hit)
    JOIN webhook_endpoints w
      ON m.event = ANY(w.events) AND (w.tenant IS NULL OR w.tenant = t.tenant)
    -- Claims, heartbeats and most finishes report nothing: filtered before the join.
    WHERE e.to_status IN ('pending', 'awaiting_approval', 'escalated', 'cancelled', 'done',
                          'failed')
      AND m.hit
    ORDER BY e.id, m.ord, w.name;
    IF FOUND THEN
        PERFORM pg_notify('orgchart_webhooks', '');
    END IF;
    RETURN NULL;
END
$$;
"""

_TRIGGER = """
CREATE TRIGGER task_events_webhook_outbox
AFTER INSERT ON task_events
REFERENCING NEW TABLE AS new_events
FOR EACH STATEMENT EXECUTE FUNCTION webhook_outbox_from_events();
"""


def upgrade() -> None:
    """Create the tables, the function and the trigger."""
    op.create_table(
        "webhook_endpoints",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("events", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=True),
        sa.Column("secret_env", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), server_default="cli", nullable=False),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True), server_default=sa.text("now()"),
                  nullable=False),
        sa.CheckConstraint("source IN ('config', 'cli')", name="ck_webhook_endpoints_source"),
        sa.PrimaryKeyConstraint("name", name="pk_webhook_endpoints"),
    )
    op.create_table(
        "webhook_outbox",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("message_id", postgresql.UUID(as_uuid=True),
                  server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("event", sa.Text(), nullable=False),
        sa.Column("root_id", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("task_id", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True),
                  server_default=sa.text("clock_timestamp()"), nullable=False),
        sa.Column("next_attempt_at", sa.TIMESTAMP(timezone=True),
                  server_default=sa.text("now()"), nullable=False),
        sa.Column("lease_token", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("lease_expires_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("delivered_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("last_response", sa.Text(), nullable=True),
        sa.CheckConstraint("status IN ('pending', 'delivered', 'dead')",
                           name="ck_webhook_outbox_status"),
        sa.CheckConstraint("octet_length(last_response) <= 1024",
                           name="ck_webhook_outbox_response_small"),
        sa.ForeignKeyConstraint(["endpoint"], ["webhook_endpoints.name"],
                                name="fk_webhook_outbox_endpoint_webhook_endpoints",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_outbox"),
        sa.UniqueConstraint("message_id", name="uq_webhook_outbox_message_id"),
    )
    op.create_index("ix_webhook_outbox_pending", "webhook_outbox", ["next_attempt_at"],
                    postgresql_where=sa.text("status = 'pending'"))
    op.create_index("ix_webhook_outbox_order", "webhook_outbox", ["endpoint", "root_id", "id"],
                    postgresql_where=sa.text("status = 'pending'"))
    op.create_index("ix_webhook_outbox_dead", "webhook_outbox", ["id"],
                    postgresql_where=sa.text("status = 'dead'"))
    op.create_index("ix_webhook_outbox_root_id", "webhook_outbox", ["root_id"])
    op.execute(_FUNCTION)
    op.execute(_TRIGGER)


def downgrade() -> None:
    """Drop the trigger, the function and the tables."""
    op.execute("DROP TRIGGER task_events_webhook_outbox ON task_events")
    op.execute("DROP FUNCTION webhook_outbox_from_events()")
    op.drop_table("webhook_outbox")
    op.drop_table("webhook_endpoints")
