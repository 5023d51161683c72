"""Standard Webhooks signatures: ``webhook-id``, ``webhook-timestamp``, ``webhook-signature``.

The secret is ``whsec_`` followed by base64 bytes (the form the ``standardwebhooks``
libraries generate and verify); the signature is ``v1,`` and the base64 HMAC-SHA256 of
``<id>.<timestamp>.<body>`` under those bytes (https://www.standardwebhooks.com/).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

from runtime.errors import BadInput

SECRET_PREFIX = "whsec_"


def secret_bytes(secret: str) -> bytes:
    """The key inside a ``whsec_<base64>`` secret.

    Raises:
        BadInput: the secret is not of that form (the message never repeats it).

    """
    text = secret.strip()
    if not text.startswith(SECRET_PREFIX):
        raise BadInput(f"a webhook secret must start with '{SECRET_PREFIX}'")
    try:
        key = base64.b64decode(text[len(SECRET_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise BadInput("a webhook secret must be 'whsec_' and base64 bytes") from None
    if len(key) < 16:
        raise BadInput("a webhook secret must hold at least 16 bytes")
    return key


def new_secret() -> str:
    """A fresh secret of 32 random bytes, in the ``whsec_`` form."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def signature(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value of one request: ``v1,<base64 HMAC-SHA256>``."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def headers(key: bytes, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The request headers of one signed delivery."""
    return {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(key, message_id, timestamp, body),
        "user-agent": "orgchart-webhooks/1",
    }
