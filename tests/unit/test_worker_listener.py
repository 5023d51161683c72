"""The worker's notification listener, over scripted notifiers (no database)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest

from runtime.engine.worker import listener as listener_module
from runtime.engine.worker.listener import Listener


class ScriptedNotifier:
    """Yields its payloads once, then stops the listener (or fails, when told to)."""

    def __init__(self, payloads: list[str], stopping: threading.Event,
                 fail_after: bool = False) -> None:
        self.payloads = payloads
        self.stopping = stopping
        self.fail_after = fail_after
        self.closed = False

    def notes(self, timeout: float) -> Iterator[str]:
        yield from self.payloads
        if self.fail_after:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        self.stopping.set()

    def close(self) -> None:
        self.closed = True


def test_the_listener_subscribes_again_after_a_failure_and_serves_wanted_payloads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listener_module, "RECONNECT_SECONDS", 0.0)
    stopping = threading.Event()
    first = ScriptedNotifier(["echo"], stopping, fail_after=True)  # a failover, say
    second = ScriptedNotifier(["other", "judge", "echo"], stopping)
    opened: list[ScriptedNotifier] = []
    script: list[object] = [psycopg.OperationalError("no server"), first, second]

    def connect() -> ScriptedNotifier:
        step = script.pop(0)
        if isinstance(step, Exception):
            raise step
        assert isinstance(step, ScriptedNotifier)
        opened.append(step)
        return step

    noted: list[str] = []
    connects: list[int] = []
    listener = Listener(connect, {"echo", "judge"}, noted.append,
                        lambda: connects.append(1), stopping)
    listener.run()
    assert opened == [first, second]
    assert all(n.closed for n in opened)
    assert noted == ["echo", "judge", "echo"]  # "other" is for another worker
    assert len(connects) == 2  # woken once per subscription: work sent meanwhile is found
