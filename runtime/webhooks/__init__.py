"""Webhooks: signed deliveries of the durable outbox (issue 39).

A change that reports something (a tree finished, a question for a person, an approval
waiting, an escalation, a cancel, a fire's rollup) writes its outbox rows in its own
transaction (migration 0013's trigger on ``task_events``; ``fire_update_finished``), one
per subscribed endpoint. This part sends them:

- ``endpoints.py``: ``[webhooks.<name>]`` copied into ``webhook_endpoints`` at start,
  ``webhooks add``; both checked by the SSRF rule first.
- ``targets.py``: the SSRF rule (http(s) only; no loopback or private address unless
  ``[webhooks] allow_private``).
- ``signing.py``: Standard Webhooks headers and signatures (``whsec_`` secrets).
- ``deliverer.py``: the loop every worker and ``serve`` runs: claim under a lease with
  SKIP LOCKED, POST, back off with jitter, dead-letter after ``max_attempts``; order per
  tree and endpoint; at-least-once with a stable ``webhook-id``.
"""

from runtime.webhooks.deliverer import (
    Attempt,
    Deliverer,
    DeliveryConfig,
    as_json,
    send_test,
    start_delivery,
    stop_delivery,
)
from runtime.webhooks.endpoints import add_endpoint, sync_configured

__all__ = ["Attempt", "Deliverer", "DeliveryConfig", "add_endpoint", "as_json", "send_test",
           "start_delivery", "stop_delivery", "sync_configured"]
