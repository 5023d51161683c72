"""The HTTP face of webhooks (``orgchart webhooks``; docs/operations.md, "Webhooks").

- ``GET /webhooks``: the endpoints, with their pending, delivered and dead events.
- ``POST /webhooks``: store one (201; replaces one of the same name); an unknown event
  name, a bad secret variable name or a URL the SSRF rule refuses is 422, and nothing
  is stored.
- ``POST /webhooks/{name}/test``: send a ``webhook.test`` event now; its row after the
  attempt (404: no such endpoint).
- ``GET /webhooks/deliveries`` (``?failed=&endpoint=&limit=``): the latest events.
- ``POST /webhooks/deliveries/{id}/redeliver``: send one again, same ``webhook-id``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field

from runtime.config import Settings
from runtime.store.rows import NotFound
from runtime.store.store import Store
from runtime.webhooks import DeliveryConfig, add_endpoint, as_json, send_test
from runtime.webhooks.endpoints import NAME_PATTERN

#: The largest outbox id (a bigint): a larger one is bad input, not a database error.
MAX_BIGINT = 2**63 - 1

_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"description": "no endpoint or event with that name or id"},
    422: {"description": "bad input (the message says which); nothing was changed"},
}


class WebhookRequest(BaseModel):
    """``POST /webhooks``: an endpoint (``[webhooks.<name>]``'s keys)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=f"^{NAME_PATTERN}$", description="Letters, digits, '_' or '-'.")
    url: str = Field(..., max_length=2000, description="Where to POST (http or https).")
    events: list[str] = Field(..., min_length=1, max_length=20,
                              description="Event names or globs (task.*).")
    secret_env: str = Field(..., max_length=200,
                            description="The variable holding the whsec_ secret.")
    tenant: str | None = Field(None, max_length=64, description="Only this tenant's trees.")


def add_webhook_routes(app: FastAPI, store: Store, settings: Settings) -> None:
    """Add the webhook endpoints to ``app`` (blocking calls: FastAPI's thread pool)."""

    @app.get("/webhooks", tags=["webhooks"])
    def list_webhooks() -> list[dict[str, Any]]:
        """The endpoints, with their pending, delivered and dead events."""
        return [as_json(r) for r in store.webhook_endpoints()]

    @app.post("/webhooks", tags=["webhooks"], status_code=201, responses=_ERRORS)
    def add_webhook(body: WebhookRequest) -> dict[str, Any]:
        """Subscribe an endpoint to events (replaces one of the same name)."""
        row = add_endpoint(store, settings, body.name, body.url, body.events,
                           body.secret_env, body.tenant)
        return {"name": row.name, "url": row.url, "events": list(row.events),
                "tenant": row.tenant, "secret_env": row.secret_env}

    @app.post("/webhooks/{name}/test", tags=["webhooks"], responses=_ERRORS)
    def test_webhook(name: str = PathParam(pattern=f"^{NAME_PATTERN}$")) -> dict[str, Any]:
        """Send a ``webhook.test`` event now; its row after the attempt."""
        return as_json(send_test(store, DeliveryConfig.from_settings(settings), name))

    @app.get("/webhooks/deliveries", tags=["webhooks"], responses=_ERRORS)
    def list_deliveries(failed: bool = False,
                        endpoint: str | None = Query(None, pattern=f"^{NAME_PATTERN}$"),
                        limit: int = Query(50, ge=1, le=10_000)) -> list[dict[str, Any]]:
        """The latest events sent or to send, newest first (``failed``: dead or failing)."""
        return [as_json(r) for r in store.webhook_deliveries(failed, endpoint, limit)]

    @app.post("/webhooks/deliveries/{outbox_id}/redeliver", tags=["webhooks"],
              responses=_ERRORS)
    def redeliver(outbox_id: int = PathParam(ge=1, le=MAX_BIGINT)) -> dict[str, Any]:
        """Send a delivered or dead event again, with the same ``webhook-id``."""
        row = store.redeliver_webhook(outbox_id)
        if row is None:
            raise NotFound(f"no webhook event {outbox_id}")
        return as_json(row)
