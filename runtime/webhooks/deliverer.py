"""The deliverer: claims outbox rows and POSTs them, signed, until each is delivered or dead.

Every worker and ``orgchart serve`` runs one in a background thread
(:func:`start_delivery`) when some endpoint is subscribed. It LISTENs on the webhook
channel (the outbox trigger notifies it at commit), claims due rows under a lease
(``webhook_outbox_claim``: ``FOR UPDATE SKIP LOCKED``, oldest first, never a tree's
event while an earlier one of it is pending for that endpoint) and sends each from a
small thread pool, so one slow receiver holds at most :data:`PER_ENDPOINT` threads,
never another endpoint's events.

Options (:class:`DeliveryConfig`, from ``[webhooks]``): attempts before the dead letter,
the backoff (doubling from ``retry_base_seconds`` up to ``retry_max_seconds``, with
jitter), the request timeout, ``allow_private``, the ``public_url`` of the links.

Failure modes: a receiver's non-2xx answer, a timeout or a refused connection is a
failed attempt (retried with backoff, dead after ``max_attempts``); a missing or
malformed secret is one too (nothing is ever sent unsigned). A deliverer that dies
mid-request leaves its rows leased: another takes them when the lease expires and
sends them with the same ``webhook-id`` (at-least-once; receivers deduplicate). A
database error in the loop is logged and the loop goes on after a pause.
"""

from __future__ import annotations

import atexit
import datetime as dt
import json
import logging
import os
import random
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from runtime.config import Settings, WebhooksSettings
from runtime.core import backoff
from runtime.errors import BadInput
from runtime.store.rows import NotFound
from runtime.store.store import Store
from runtime.store.webhooks import MAX_RESPONSE_BYTES
from runtime.webhooks.signing import headers, secret_bytes
from runtime.webhooks.targets import check_url

log = logging.getLogger(__name__)

#: Requests in flight at once per process.
THREADS = 16
#: Requests in flight at once per endpoint (a slow receiver holds no more threads).
PER_ENDPOINT = 8
#: Seconds between claims when no notification comes (backoffs that came due).
POLL_SECONDS = 2.0
#: Seconds between checks for freed room while requests are in flight.
BUSY_POLL_SECONDS = 0.02
#: Seconds a claimed row is leased beyond the request's timeout.
LEASE_MARGIN_SECONDS = 5.0
#: Seconds to wait after a database error before the loop tries again.
ERROR_PAUSE_SECONDS = 1.0


@dataclass(frozen=True)
class DeliveryConfig:
    """How one deliverer sends: the ``[webhooks]`` section and the process's own limits.

    The section holds every user-facing value and its default, once (:mod:`runtime.config`).
    """

    webhooks: WebhooksSettings = field(default_factory=WebhooksSettings)
    threads: int = THREADS
    per_endpoint: int = PER_ENDPOINT
    poll_seconds: float = POLL_SECONDS

    def __post_init__(self) -> None:
        if self.threads < 1 or self.per_endpoint < 1:
            raise ValueError("threads and per_endpoint must be at least 1")

    @property
    def lease_seconds(self) -> float:
        """A claimed row's lease: the request's timeout and a margin."""
        return self.webhooks.timeout_seconds + LEASE_MARGIN_SECONDS

    @property
    def public_url(self) -> str:
        """The API's address for the links in payloads, without a trailing slash."""
        return self.webhooks.public_url.rstrip("/")

    @classmethod
    def from_settings(cls, settings: Settings) -> DeliveryConfig:
        """The ``[webhooks]`` section's values."""
        return cls(settings.webhooks)


def backoff_seconds(attempt: int, base: float, cap: float,
                    rand: Callable[[], float] = random.random) -> float:
    """Seconds before the attempt after ``attempt`` (1-based): doubling, capped, jittered.

    "Equal jitter": half the doubled delay fixed, the other half random, so retries of
    many events that failed together spread out but never come back at once.
    """
    return backoff.delay(attempt - 1, base, cap, jitter="equal", rand=rand)


def message_id(row: Mapping[str, Any]) -> str:
    """The ``webhook-id`` of an outbox row: the same on every attempt."""
    return f"msg_{row['message_id'].hex}"


def request_body(row: Mapping[str, Any], public_url: str) -> bytes:
    """The JSON body: ``{"type", "timestamp", "data"}`` with the links for a person."""
    data = dict(row["payload"])
    root, task = data.get("root_id"), data.get("task_id")
    if root:
        data["url"] = f"{public_url}/ui/trees/{root}"
    if row["event"] == "task.question" and task:
        data["answer"] = {"command": f"orgchart answer {task} --json '<answer as JSON>'",
                          "url": f"{public_url}/tasks/{task}/answer", "method": "POST",
                          "body": {"answer": "<answer as JSON>", "by": "<who>"}}
    created: dt.datetime = row["created_at"]
    envelope = {"type": row["event"], "timestamp": created.isoformat(), "data": data}
    return json.dumps(envelope, separators=(",", ":"), default=str).encode()


@dataclass(frozen=True)
class Attempt:
    """What one request came to: ``delivered``, ``retry``, ``dead`` or ``lost`` (fenced)."""

    outbox_id: int
    outcome: str
    http_status: int | None = None
    error: str | None = None


class Deliverer:
    """Sends the outbox: :meth:`run_once` by hand (tests), :meth:`start` in a thread.

    Args:
        store: the database door.
        config: how to send.
        env: where the secrets' variables are read (default ``os.environ``, at each send).
        client: the HTTP client (default: one of its own, never following redirects).

    """

    def __init__(self, store: Store, config: DeliveryConfig,
                 env: Mapping[str, str] | None = None, client: httpx.Client | None = None
                 ) -> None:
        self.store = store
        self.config = config
        self._env = env
        self._client = client or httpx.Client(follow_redirects=False, trust_env=False)
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="webhook")
        self._lock = threading.Lock()
        self._inflight: Counter[str] = Counter()
        self._room = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ one pass
    def run_once(self) -> list[Attempt]:
        """Claim what is due now, send it all, and wait for the answers."""
        futures = self._fill()
        return [f.result() for f in futures]

    def _fill(self) -> list[Future[Attempt]]:
        """Claim rows for the free threads and hand each to the pool."""
        futures: list[Future[Attempt]] = []
        while True:
            with self._lock:
                free = self.config.threads - sum(self._inflight.values())
                busy = [e for e, n in self._inflight.items() if n >= self.config.per_endpoint]
            if free <= 0:
                return futures
            token = uuid.uuid4()
            rows = self.store.webhooks.claim(min(free, self.config.per_endpoint), busy,
                                             self.config.lease_seconds, token)
            if not rows:
                return futures
            for row in rows:
                with self._lock:
                    self._inflight[row["endpoint"]] += 1
                futures.append(self._pool.submit(self._deliver, row, token))

    def _deliver(self, row: Mapping[str, Any], token: uuid.UUID) -> Attempt:
        try:
            return self._record(row, token, *self._post(row))
        except Exception:  # the database: the lease expires and another deliverer retries
            log.warning("webhook outcome not recorded", exc_info=True,
                        extra={"outbox_id": row["id"]})
            return Attempt(row["id"], "lost")
        finally:
            with self._lock:
                self._inflight[row["endpoint"]] -= 1
                if self._inflight[row["endpoint"]] <= 0:
                    del self._inflight[row["endpoint"]]
            self._room.set()

    def _post(self, row: Mapping[str, Any]) -> tuple[int | None, str | None, str | None]:
        """Send one row: ``(http status, error, first KB of the answer)``."""
        env = os.environ if self._env is None else self._env
        try:
            secret = env.get(row["secret_env"])
            if not secret:
                raise BadInput(f"the secret variable {row['secret_env']} is not set")
            key = secret_bytes(secret)
            check_url(row["url"], self.config.webhooks.allow_private)
        except BadInput as exc:
            return None, str(exc), None
        body = request_body(row, self.config.public_url)
        sign = headers(key, message_id(row), int(time.time()), body)
        try:
            with self._client.stream("POST", row["url"], content=body, headers=sign,
                                     timeout=self.config.webhooks.timeout_seconds) as resp:
                answer = _first_bytes(resp)
                if 200 <= resp.status_code < 300:
                    return resp.status_code, None, answer
                return resp.status_code, f"HTTP {resp.status_code}", answer
        except Exception as exc:  # any failure to send is a failed attempt, never a lost one
            return None, f"{type(exc).__name__}: {exc}".rstrip(": "), None

    def _record(self, row: Mapping[str, Any], token: uuid.UUID, status: int | None,
                error: str | None, answer: str | None) -> Attempt:
        if error is None and status is not None:
            ok = self.store.webhooks.delivered(row["id"], token, status, answer)
            return Attempt(row["id"], "delivered" if ok else "lost", status)
        delay = backoff_seconds(row["attempts"], self.config.webhooks.retry_base_seconds,
                                self.config.webhooks.retry_max_seconds)
        state = self.store.webhooks.failed(
            row["id"], token, http_status=status, error=error or "failed", response=answer,
            delay_seconds=delay, max_attempts=self.config.webhooks.max_attempts)
        if state == "dead":
            log.warning("webhook dead-lettered", extra={"outbox_id": row["id"],
                                                        "endpoint": row["endpoint"]})
        outcome = {"dead": "dead", "pending": "retry"}.get(state or "", "lost")
        return Attempt(row["id"], outcome, status, error)

    # ------------------------------------------------------------------ the loop
    def start(self) -> Deliverer:
        """Run the loop in a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="webhook-deliverer",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop claiming and wait up to ``timeout`` s for the loop.

        Requests in flight end on their own (an unfinished one is sent again after its
        lease).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.close()

    def close(self) -> None:
        """Let the pool's threads go (requests in flight finish on their own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self.store.webhooks.channel() as channel:
                    self._serve(channel)
            except Exception:
                log.warning("webhook deliverer: database error; trying again", exc_info=True)
                self._stop.wait(ERROR_PAUSE_SECONDS)

    def _serve(self, channel: Any) -> None:
        """Claim at each notification, freed thread and poll; wait on the channel between."""
        due = 0.0
        while not self._stop.is_set():
            if self._room.is_set() or time.monotonic() >= due:
                self._room.clear()
                self._fill()
                due = time.monotonic() + self.config.poll_seconds
            with self._lock:
                busy = bool(self._inflight)
            for _note in channel.notes(BUSY_POLL_SECONDS if busy else self.config.poll_seconds):
                self._room.set()
                break


def _first_bytes(resp: httpx.Response) -> str:
    """At most :data:`MAX_RESPONSE_BYTES` of the answer: the rest is never read."""
    data = b""
    for chunk in resp.iter_raw():
        data += chunk
        if len(data) >= MAX_RESPONSE_BYTES:
            break
    return data[:MAX_RESPONSE_BYTES].decode("utf-8", errors="replace")


#: Extra seconds :func:`send_test` waits beyond the request's timeout.
TEST_WAIT_MARGIN_SECONDS = 2.0


def send_test(store: Store, config: DeliveryConfig, name: str) -> dict[str, Any]:
    """Queue a ``webhook.test`` event for endpoint ``name``, deliver it now; its row after.

    Delivered from this process (``webhooks test``, ``POST /webhooks/{name}/test``), so
    the answer is known at once; another deliverer may take it first (then its row says
    what that one got).

    Raises:
        NotFound: no endpoint of that name.

    """
    from runtime.webhooks.endpoints import NAME_PATTERN

    queued = store.webhooks.queue_test(name) if re.fullmatch(NAME_PATTERN, name) else None
    if queued is None:
        raise NotFound(f"no webhook endpoint named {name!r} (orgchart webhooks list)")
    deliverer = Deliverer(store, config)
    deadline = time.monotonic() + config.webhooks.timeout_seconds + TEST_WAIT_MARGIN_SECONDS
    try:
        while True:
            attempts = deliverer.run_once()
            row = store.webhooks.delivery(queued["id"])
            if (any(a.outbox_id == queued["id"] for a in attempts) or row["attempts"]
                    or time.monotonic() > deadline):
                return row
            time.sleep(0.05)  # an earlier event of the endpoint goes first
    finally:
        deliverer.close()


def as_json(row: Mapping[str, Any]) -> dict[str, Any]:
    """An endpoint's or an outbox row's JSON shape (ids and times as strings)."""
    return {k: (str(v) if isinstance(v, uuid.UUID)
                else v.isoformat() if isinstance(v, dt.datetime) else v)
            for k, v in row.items()}


_running: Deliverer | None = None
_start_lock = threading.Lock()


def start_delivery(store: Store, settings: Settings) -> Deliverer | None:
    """Store the configured endpoints and start this process's deliverer, once.

    Nothing starts (None) when no endpoint is subscribed, in the configuration or the
    database: a process started before the first ``webhooks add`` delivers after its
    restart (any other running worker or ``serve`` with endpoints delivers meanwhile).

    Raises:
        BadInput: a configured endpoint the SSRF rule refuses.

    """
    global _running
    from runtime.webhooks.endpoints import sync_configured

    sync_configured(store, settings)
    if not settings.webhooks.endpoints and not store.webhooks.endpoints():
        return None
    with _start_lock:
        if _running is None:
            _running = Deliverer(store, DeliveryConfig.from_settings(settings)).start()
            atexit.register(stop_delivery)
        return _running


def stop_delivery() -> None:
    """Stop this process's deliverer, if it runs."""
    global _running
    with _start_lock:
        running, _running = _running, None
    if running is not None:
        running.stop()
