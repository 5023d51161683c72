"""The subscribed endpoints: copied from ``[webhooks.<name>]`` at start, or added by hand.

The outbox trigger only writes events when ``webhook_endpoints`` has a row, so the
configured endpoints are stored when a worker or ``serve`` starts
(:func:`sync_configured`: the configured ones replace their rows, and those that left the
configuration are forgotten with their undelivered events); ``orgchart webhooks add``
stores one more (:func:`add_endpoint`). Both check the URL against the SSRF rule
(:mod:`runtime.webhooks.targets`) and the event names first: bad input changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pydantic import ValidationError

from runtime.config import Settings, WebhookEndpointSettings
from runtime.errors import BadInput
from runtime.store.store import Store
from runtime.store.webhooks import EndpointRow
from runtime.webhooks.targets import check_url

#: What an endpoint's name may be.
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}"


def endpoint_row(name: str, entry: WebhookEndpointSettings, allow_private: bool,
                 resolve: bool = True) -> EndpointRow:
    """The row of one configured endpoint, its name and URL checked.

    With ``resolve`` the host's addresses are checked too, else a literal address only.

    Raises:
        BadInput: a bad name, or a URL the SSRF rule refuses.

    """
    if not re.fullmatch(NAME_PATTERN, name):
        raise BadInput(f"bad webhook name {name!r}: letters, digits, '_' or '-' (at most 64)")
    check_url(entry.url, allow_private, resolve)
    return EndpointRow(name=name, url=entry.url, events=tuple(entry.events),
                       secret_env=entry.secret_env, tenant=entry.tenant)


def sync_configured(store: Store, settings: Settings) -> list[str]:
    """Store the ``[webhooks.<name>]`` endpoints; forget configured ones no longer there.

    Returns the names of the endpoints forgotten.

    Raises:
        BadInput: an endpoint the SSRF rule refuses by its scheme or a literal
            address (nothing is stored then).

    """
    hooks = settings.webhooks
    # No lookup here: a receiver's DNS being down must not stop a worker from starting
    # (every delivery checks the addresses the name resolves to then).
    rows = [endpoint_row(name, entry, hooks.allow_private, resolve=False)
            for name, entry in sorted(hooks.endpoints.items())]
    return store.webhooks.upsert_endpoints(rows, source="config", prune=True)


def add_endpoint(store: Store, settings: Settings, name: str, url: str, events: Sequence[str],
                 secret_env: str, tenant: str | None = None) -> EndpointRow:
    """Validate and store one endpoint (``orgchart webhooks add``; the API's POST).

    Raises:
        BadInput: an unknown event name, a bad secret variable name or tenant, or a URL
            the SSRF rule refuses; nothing is stored then.

    """
    if not re.fullmatch(NAME_PATTERN, name):
        raise BadInput(f"bad webhook name {name!r}: letters, digits, '_' or '-' (at most 64)")
    check_url(url, settings.webhooks.allow_private)  # the SSRF rule's message first
    try:
        entry = WebhookEndpointSettings(url=url, events=list(events), secret_env=secret_env,
                                        tenant=tenant)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise BadInput(f"webhook {name!r}: bad {where}: {message}") from None
    row = endpoint_row(name, entry, settings.webhooks.allow_private)
    store.webhooks.upsert_endpoints([row], source="cli")
    return row
