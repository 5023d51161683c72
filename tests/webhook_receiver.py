"""A loopback webhook receiver that verifies each request with ``standardwebhooks``.

Used by the webhook tests and ``bench/webhooks.py``. Every request is verified with the
Standard Webhooks library (a request that fails verification is answered 401 and
counted as ``unsigned``); ``answer`` decides the status of each request (default 200),
``hang`` makes it wait (a receiver that times out), ``body`` what it answers.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

#: A ``whsec_`` secret for tests (32 bytes).
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@dataclass
class Received:
    """One verified request."""

    webhook_id: str
    event: str
    data: dict[str, Any]
    at: float


@dataclass
class Receiver:
    """A receiver on 127.0.0.1; :meth:`start`, then read :attr:`received`; :meth:`stop`."""

    secret: str = SECRET
    answer: Callable[[int], int] = lambda n: 200
    hang: Callable[[int], float] = lambda n: 0.0
    body: str = "ok"
    received: list[Received] = field(default_factory=list)
    unsigned: int = 0
    requests: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        """The URL to subscribe."""
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/hook"

    def start(self) -> Receiver:
        """Listen on a free port, serving from a thread."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                status = receiver.handle(raw, dict(self.headers))
                answer = receiver.body.encode()
                self.send_response(status)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a sender that gave up on a hung request closed the connection

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def handle(self, raw: bytes, headers: dict[str, str]) -> int:
        """Verify and record one request; the status to answer."""
        with self._lock:
            self.requests += 1
            n = self.requests
        wait = self.hang(n)
        if wait:
            time.sleep(wait)
        lowered = {k.lower(): v for k, v in headers.items()}
        try:
            Webhook(self.secret).verify(raw, lowered)
        except WebhookVerificationError:
            with self._lock:
                self.unsigned += 1
            return 401
        status = self.answer(n)
        if 200 <= status < 300:
            body = json.loads(raw)
            with self._lock:
                self.received.append(Received(lowered["webhook-id"], body["type"],
                                              body["data"], time.monotonic()))
        return status

    def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
