"""The notification listener: wakes the claim loop when work for this worker is announced.

New or released work is announced on the task channel (the store's ``TASKS_CHANNEL``; the
payload is the agent name, ``judge`` for the judge stage). :class:`Listener` runs in a
daemon thread: it opens a :class:`Notifier` (by default the store's
:class:`~runtime.store.notify.TaskChannel`, subscribed with ``channel_listen_tasks``),
wakes the worker once on every (re)connection (anything announced while it was away is
in the table), then hands each payload it serves to ``on_note``.

The seam is :data:`NotifierFactory`: whatever opens a notifier decides where it connects.
A factory that finds the current primary makes the listener follow a failover: when a
notifier fails, the listener closes it, waits :data:`RECONNECT_SECONDS` and opens a new
one, which subscribes again.

Failure modes: a dropped connection or a server that does not answer is logged at INFO
and retried every :data:`RECONNECT_SECONDS` until the worker stops; meanwhile the worker
still polls every ``poll_interval_seconds``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from runtime.engine.worker.settings import DB_ERRORS

log = logging.getLogger(__name__)

#: Seconds between attempts to subscribe again after the notifier failed.
RECONNECT_SECONDS = 1.0
#: Longest wait for a notification before the listener checks whether it should stop.
WAIT_SECONDS = 1.0
#: What makes the listener subscribe again: the database's errors and the network's.
RECONNECT_ON: tuple[type[Exception], ...] = (*DB_ERRORS, OSError)


class Notifier(Protocol):
    """A subscription to the task channel."""

    def notes(self, timeout: float) -> Iterable[str]:
        """Yield each payload as it arrives, for up to ``timeout`` seconds."""
        ...

    def close(self) -> None:
        """End the subscription."""
        ...


#: Opens a subscribed :class:`Notifier` (raises a database error when it cannot).
NotifierFactory = Callable[[], Notifier]


class Listener:
    """Listens for work in a daemon thread until ``stopping`` is set.

    Args:
        connect: opens a subscribed notifier (called again after each failure).
        wanted: the payloads that mean work for this worker.
        on_note: called with each wanted payload (from the listener's thread).
        on_connect: called after each (re)subscription.
        stopping: set when the worker stops.

    """

    def __init__(self, connect: NotifierFactory, wanted: set[str],
                 on_note: Callable[[str], None], on_connect: Callable[[], None],
                 stopping: threading.Event) -> None:
        self.connect = connect
        self.wanted = frozenset(wanted)
        self.on_note = on_note
        self.on_connect = on_connect
        self.stopping = stopping
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start listening in a daemon thread."""
        self._thread = threading.Thread(target=self.run, name="listen", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Listen, subscribing again after each failure, until ``stopping`` is set."""
        while not self.stopping.is_set():
            try:
                self.listen_once()
            except RECONNECT_ON as exc:
                log.info("listener reconnecting", extra={"error": str(exc)})
                self.stopping.wait(RECONNECT_SECONDS)

    def listen_once(self) -> None:
        """One subscription: open a notifier, serve its payloads until stopping or failure."""
        notifier = self.connect()
        try:
            self.on_connect()
            while not self.stopping.is_set():
                for payload in notifier.notes(WAIT_SECONDS):
                    if payload in self.wanted:
                        self.on_note(payload)
        finally:
            notifier.close()
