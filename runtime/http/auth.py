"""Who may call the HTTP API: the bearer token and the loopback rule."""

from __future__ import annotations

import ipaddress
import os

#: The environment variable holding the API's bearer token.
API_TOKEN_ENV = "ORGCHART_API_TOKEN"


def is_loopback(host: str) -> bool:
    """True when ``host`` only listens on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_token(env: dict[str, str] | None = None) -> str | None:
    """The configured API token (``ORGCHART_API_TOKEN``), None when unset or empty."""
    value = (os.environ if env is None else env).get(API_TOKEN_ENV, "")
    return value or None
