"""Where a webhook may go: the SSRF rule.

Only ``http`` and ``https`` URLs with a host; every address the host resolves to must be
public: loopback, private (RFC 1918, unique-local), link-local (cloud metadata at
169.254.169.254), multicast, reserved and unspecified addresses are refused unless
``[webhooks] allow_private = true``. The rule runs when an endpoint is stored and again
before each delivery (a name may resolve elsewhere later). Redirects are never followed.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from runtime.errors import BadInput


def _refused(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (address.is_loopback or address.is_private or address.is_link_local
            or address.is_multicast or address.is_reserved or address.is_unspecified)


def check_url(url: str, allow_private: bool, resolve: bool = True) -> None:
    """Refuse ``url`` unless it is http(s) to a public address (or ``allow_private``).

    Args:
        url: the endpoint's URL.
        allow_private: ``[webhooks] allow_private``: loopback and private ranges allowed.
        resolve: look the host name up (else only a literal address is checked).

    Raises:
        BadInput: the scheme, the host, or an address it resolves to is refused.

    """
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as exc:  # a bad port or bracket
        raise BadInput(f"webhook URL {url!r} cannot be read: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise BadInput(f"webhook URL {url!r}: only http and https are allowed")
    if not host:
        raise BadInput(f"webhook URL {url!r} names no host")
    if allow_private:
        return
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        raise _private(url, host)
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        if _refused(literal):
            raise _private(url, host)
        return
    if resolve:
        for address in _addresses(url, host, port):
            if _refused(address):
                raise _private(url, str(address))


def _addresses(url: str, host: str, port: int | None
               ) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        infos = socket.getaddrinfo(host, port or 443, type=socket.SOCK_STREAM)
    except (OSError, ValueError, UnicodeError) as exc:  # ValueError: a NUL in the name
        raise BadInput(f"webhook URL {url!r}: cannot resolve {host!r} ({exc})") from None
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


def _private(url: str, where: str) -> BadInput:
    return BadInput(f"webhook URL {url!r} reaches a loopback or private address ({where}); "
                    "set [webhooks] allow_private = true to allow it")
