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

from typing import Annotated, Any

from fastapi import FastAPI, Query
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from runtime.config import Settings, expand_webhook_events
from runtime.constants import TENANT_NAME_PATTERN, WEBHOOK_EVENTS
from runtime.store.rows import NotFound
from runtime.store.store import Store
from runtime.webhooks import DeliveryConfig, add_endpoint, as_json, send_test
from runtime.webhooks.endpoints import NAME_PATTERN

#: The largest outbox id (a bigint): a larger one is bad input, not a database error.
MAX_BIGINT = 2**63 - 1

#: An http(s) URL with a host name or address (no user, no IPv6 literal), an optional
#: port (0 to 65535) and path: what the SSRF rule can read. Whether the host may
#: receive (not loopback or private unless ``[webhooks] allow_private``, and it must
#: resolve) is the server's to say: a refused host answers 422.
URL_PATTERN = (r"^https?://[^\x00-\x20\x7f/?#@\[\]:\\]+"
               r"(?::(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}"
               r"|[1-5][0-9]{4}|[0-9]{1,4}))?(?:[/?#][^\x00-\x20\x7f]*)?$")
#: What ``events`` may hold: an event's name, or a glob naming a family.
EVENT_CHOICES = (*WEBHOOK_EVENTS, "*", *sorted({e.split(".")[0] + ".*" for e in WEBHOOK_EVENTS}))
Event = Annotated[str, WithJsonSchema({"type": "string", "enum": list(EVENT_CHOICES)})]

_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"description": "no endpoint or event with that name or id"},
    422: {"description": "bad input (the message says which); nothing was changed"},
}


class WebhookRequest(BaseModel):
    """``POST /webhooks``: an endpoint (``[webhooks.<name>]``'s keys)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=f"^{NAME_PATTERN}$", description="Letters, digits, '_' or '-'.")
    url: str = Field(..., max_length=2000, pattern=URL_PATTERN,
                     description="Where to POST (http or https). A host that is loopback "
                                 "or private (unless [webhooks] allow_private), or that does "
                                 "not resolve, is refused (422).")
    events: list[Event] = Field(..., min_length=1, max_length=20,
                                description="Event names or globs (task.*).")
    secret_env: str = Field(..., max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                            description="The variable holding the whsec_ secret.")
    tenant: str | None = Field(None, pattern=TENANT_NAME_PATTERN,
                               description="Only this tenant's trees.")

    @field_validator("events")
    @classmethod
    def _known_events(cls, value: list[str]) -> list[str]:
        for event in value:
            if event not in EVENT_CHOICES:
                expand_webhook_events([event])  # raises, with the closest name
                raise ValueError(f"events: use a name or one of "
                                 f"{', '.join(EVENT_CHOICES[len(WEBHOOK_EVENTS):])}")
        return value


def add_webhook_routes(app: FastAPI, store: Store, settings: Settings) -> None:
    """Add the webhook endpoints to ``app`` (blocking calls: FastAPI's thread pool)."""

    @app.get("/webhooks", tags=["webhooks"])
    def list_webhooks() -> list[dict[str, Any]]:
        """The endpoints, with their pending, delivered and dead events."""
        return [as_json(r) for r in store.webhooks.endpoints()]

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
        return [as_json(r) for r in store.webhooks.deliveries(failed, endpoint, limit)]

    @app.post("/webhooks/deliveries/{outbox_id}/redeliver", tags=["webhooks"],
              responses=_ERRORS)
    def redeliver(outbox_id: int = PathParam(ge=1, le=MAX_BIGINT)) -> dict[str, Any]:
        """Send a delivered or dead event again, with the same ``webhook-id``."""
        row = store.webhooks.redeliver(outbox_id)
        if row is None:
            raise NotFound(f"no webhook event {outbox_id}")
        return as_json(row)
