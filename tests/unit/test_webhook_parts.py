"""The webhook pieces that need no server: signatures, the SSRF rule, backoff, event names."""

from __future__ import annotations

import time

import pytest
from standardwebhooks.webhooks import Webhook

from runtime.config import expand_webhook_events
from runtime.constants import WEBHOOK_EVENTS
from runtime.errors import BadInput
from runtime.webhooks.deliverer import backoff_seconds
from runtime.webhooks.signing import headers, new_secret, secret_bytes
from runtime.webhooks.targets import check_url


def test_a_signature_verifies_with_the_standard_webhooks_library() -> None:
    secret = new_secret()
    body = b'{"type":"tree.finished","data":{}}'
    sent = headers(secret_bytes(secret), "msg_1", 1_700_000_000, body)
    wh = Webhook(secret)
    with pytest.raises(Exception, match="too old"):  # the library checks the clock too
        wh.verify(body, sent)
    fresh = headers(secret_bytes(secret), "msg_1", int(time.time()), body)
    assert wh.verify(body, fresh) == {"type": "tree.finished", "data": {}}
    with pytest.raises(Exception, match="signature"):
        wh.verify(body + b" ", fresh)


@pytest.mark.parametrize("secret", ["abc", "whsec_!!!", "whsec_YWJj"])
def test_a_malformed_secret_is_refused_without_repeating_it(secret: str) -> None:
    with pytest.raises(BadInput, match="a webhook secret must") as caught:
        secret_bytes(secret)
    assert secret not in str(caught.value)


@pytest.mark.parametrize("url", [
    "ftp://example.com/x", "http:///x", "http://127.0.0.1/x", "http://localhost:8/x",
    "http://10.0.0.1/", "http://192.168.1.2/", "http://169.254.169.254/latest/meta-data",
    "http://[::1]/", "http://[::ffff:127.0.0.1]/", "http://0.0.0.0/", "http://224.0.0.1/",
])
def test_the_ssrf_rule_refuses_what_is_not_public_http(url: str) -> None:
    with pytest.raises(BadInput):
        check_url(url, allow_private=False, resolve=False)


def test_allow_private_lets_loopback_through_but_never_another_scheme() -> None:
    check_url("http://127.0.0.1:9/x", allow_private=True)
    check_url("https://93.184.216.34/x", allow_private=False, resolve=False)
    with pytest.raises(BadInput):
        check_url("file:///etc/passwd", allow_private=True)


def test_backoff_doubles_is_jittered_and_capped() -> None:
    assert [backoff_seconds(a, 1, 3600, rand=lambda: 0.0) for a in (1, 2, 3)] == [0.5, 1, 2]
    assert [backoff_seconds(a, 1, 3600, rand=lambda: 1.0) for a in (1, 2, 3)] == [1, 2, 4]
    assert backoff_seconds(40, 1, 60, rand=lambda: 1.0) == 60


def test_globs_expand_to_event_names_and_an_unknown_name_is_refused() -> None:
    assert expand_webhook_events(["task.*"]) == [e for e in WEBHOOK_EVENTS if e[:5] == "task."]
    assert expand_webhook_events(["*"]) == list(WEBHOOK_EVENTS)
    with pytest.raises(ValueError, match=r"did you mean .tree\.finished."):
        expand_webhook_events(["tree.finishd"])
