"""uvicorn serving an ASGI app in a thread, on a loopback port bound before it starts.

What the browser and stream tests, and ``bench.stream_reads``, serve their app with.
"""

from __future__ import annotations

import socket
import threading
from typing import Any


class Server:
    """uvicorn serving ``app`` in a thread; ``url`` is its loopback address."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        started = threading.Event()
        for _ in range(200):
            if self.server.started:
                started.set()
                break
            started.wait(0.05)
        if not started.is_set():
            raise RuntimeError("uvicorn did not start within 10 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
