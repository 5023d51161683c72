"""The webhook outbox's statements: endpoints, claims with leases, outcomes, the listing.

A part of the store (``store.webhooks``, :class:`Webhooks`). The outbox rows themselves
are written by the trigger of migration 0013 (``webhook_outbox_from_events``) in the
transaction of the change they report, and by ``fire_update_finished`` for a fire's
rollup; this module reads and moves them (``runtime/webhooks/`` sends them).

Two deliverers never hold one row (``FOR UPDATE SKIP LOCKED`` under a lease); a dead
deliverer's rows come back when their lease expires, with the same ``message_id``; a late
deliverer's outcome is fenced by its lease token and changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.store.database import Database
from runtime.store.notify import TaskChannel
from runtime.store.queries import Task
from runtime.store.rows import NotFound

_rows = Database.rows

#: The most of a receiver's answer ever stored (bytes).
MAX_RESPONSE_BYTES = 1024


@dataclass(frozen=True)
class EndpointRow:
    """One endpoint to store: events already expanded to names."""

    name: str
    url: str
    events: tuple[str, ...]
    secret_env: str
    tenant: str | None = None


def clip(text: str | None, limit: int = MAX_RESPONSE_BYTES) -> str | None:
    """``text`` cut to at most ``limit`` bytes of UTF-8 (never a broken character)."""
    if text is None:
        return None
    return text.encode("utf-8")[:limit].decode("utf-8", errors="ignore")


class Webhooks:
    """Endpoints and the outbox's deliveries (``store.webhooks``)."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def upsert_endpoints(self, rows: Sequence[EndpointRow], source: str,
                         prune: bool = False) -> list[str]:
        """Store ``rows``, replacing same-named ones; return the names removed.

        With ``prune``, the ``source = 'config'`` endpoints not among ``rows`` are
        forgotten (their undelivered events with them).
        """
        with self.database.transaction() as conn:
            for row in rows:
                _rows(conn, "webhook_endpoint_upsert", endpoint=row.name, url=row.url,
                      events=list(row.events), tenant=row.tenant,
                      secret_env=row.secret_env, source=source)
            if not prune:
                return []
            gone = _rows(conn, "webhook_endpoint_delete_unconfigured",
                         names=[row.name for row in rows])
            return [g["name"] for g in gone]

    def endpoints(self) -> list[Task]:
        """Every endpoint with its pending, delivered and dead counts."""
        return self.database.query("webhook_endpoint_list")

    def queue_test(self, name: str) -> Task | None:
        """Queue a ``webhook.test`` event for endpoint ``name`` (None: no such endpoint)."""
        with self.database.transaction() as conn:
            rows = _rows(conn, "webhook_outbox_insert_test", endpoint=name)
        return rows[0] if rows else None

    def claim(self, n: int, busy: Sequence[str], lease_seconds: float,
              token: uuid.UUID) -> list[Task]:
        """Lease up to ``n`` due events (none of the ``busy`` endpoints), oldest first."""
        with self.database.transaction() as conn:
            return _rows(conn, "webhook_outbox_claim", n=n, busy=list(busy),
                         lease_seconds=lease_seconds, token=token)

    def delivered(self, outbox_id: int, token: uuid.UUID, http_status: int,
                  response: str | None) -> bool:
        """Record a 2xx; False when the lease was taken over (nothing changed)."""
        with self.database.transaction() as conn:
            return bool(_rows(conn, "webhook_outbox_delivered", id=outbox_id, token=token,
                              http_status=http_status, response=clip(response)))

    def failed(self, outbox_id: int, token: uuid.UUID, *, http_status: int | None,
               error: str, response: str | None, delay_seconds: float,
               max_attempts: int) -> str | None:
        """Record a failed attempt: ``pending`` (retried later) or ``dead``.

        None when the lease was taken over (nothing changed).
        """
        with self.database.transaction() as conn:
            rows = _rows(conn, "webhook_outbox_failed", id=outbox_id, token=token,
                         http_status=http_status, error=clip(error),
                         response=clip(response), delay_seconds=delay_seconds,
                         max_attempts=max_attempts)
        return rows[0]["status"] if rows else None

    def deliveries(self, failed: bool = False, endpoint: str | None = None,
                   limit: int = 50) -> list[Task]:
        """The latest outbox rows, newest first (``failed``: dead or failing only)."""
        return self.database.query("webhook_outbox_list", failed=failed, endpoint=endpoint,
                                   n=limit)

    def delivery(self, outbox_id: int) -> dict[str, Any]:
        """One outbox row, as :meth:`deliveries` shows it.

        Raises:
            NotFound: no such row.

        """
        rows = self.database.query("webhook_outbox_get", id=outbox_id)
        if not rows:
            raise NotFound(f"no webhook event {outbox_id}")
        return rows[0]

    def redeliver(self, outbox_id: int) -> Task | None:
        """Send a delivered or dead event again (same webhook-id); None if not such a row."""
        with self.database.transaction() as conn:
            rows = _rows(conn, "webhook_outbox_redeliver", id=outbox_id)
            if rows:
                return rows[0]
            found = _rows(conn, "webhook_outbox_get", id=outbox_id)
        return found[0] if found else None

    def health(self, alert_after: float) -> dict[str, Any]:
        """Dead letters, and the backlog older than ``alert_after`` seconds (doctor)."""
        return self.database.query("webhook_outbox_health", alert_after=alert_after)[0]

    def channel(self) -> TaskChannel:
        """A connection LISTENing on the webhook channel (close it when done)."""
        return TaskChannel(self.database.engine.url.render_as_string(hide_password=False),
                           listen="channel_listen_webhooks")
