"""The stop check: a worker holding a cancelled task stops it within a second.

``orgchart cancel`` clears the leases of the tasks it ends, so every write of their
worker would match nothing anyway; this makes the worker stop *working* on them too.
:meth:`StopWatcher.check_once` reads the state of every task held (one batched read on
primary keys) and, for each one now ``cancelled``:

- aborts it (:meth:`~runtime.engine.worker.state.InFlight.abort`): its coroutine is
  cancelled, nothing of it is written (a sync agent's thread runs to its end, ignored);
- tells the model layer's start gate (:class:`~runtime.llm.gate.CallGate`): its requests
  in flight are cancelled and no later call of it starts.

The check runs every :data:`STOP_CHECK_SECONDS` while the worker holds tasks, and at once
when poked: by the ``cancel`` notification (the store's NOTIFY) and by the heartbeat
when it finds leases gone. Nothing depends on the notification arriving: the poll alone
stops a cancelled task within :data:`STOP_CHECK_SECONDS` plus one read.

Failure modes: a database error is counted and logged once per streak; the next check
tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence
from typing import Protocol

from runtime.engine.worker.settings import DB_ERRORS
from runtime.engine.worker.state import DbHealth, Held, InFlight
from runtime.store.store import Store

log = logging.getLogger(__name__)

#: Seconds between two stop checks while the worker holds tasks.
STOP_CHECK_SECONDS = 0.5
#: The notification payloads a cancel and a pause send (``task_cancel_subtree``,
#: ``tree_pause_insert``): the model layer's gate reads again, a cancel is looked for.
CANCEL_NOTE = "cancel"
PAUSE_NOTE = "pause"


class Gate(Protocol):
    """What the stop check tells the model layer (:class:`runtime.llm.gate.CallGate`)."""

    def stop(self, task_ids: Sequence[uuid.UUID]) -> int:
        """Refuse the tasks' later calls and cancel their requests in flight."""
        ...


class StopWatcher:
    """Finds the held tasks that were cancelled and stops them (see the module doc).

    Args:
        store: the database.
        held: what the worker holds.
        gate: the model layer's start gate (None: no model layer to tell).
        health: where database errors are counted.
        interval: seconds between checks while tasks are held.

    """

    def __init__(self, store: Store, held: Held, gate: Gate | None, health: DbHealth,
                 interval: float = STOP_CHECK_SECONDS) -> None:
        self.store = store
        self.held = held
        self.gate = gate
        self.health = health
        self.interval = interval
        self.stopped = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poked: asyncio.Event | None = None

    def check_once(self) -> list[InFlight]:
        """Stop every held task that was cancelled; returns them (blocking: one read)."""
        items = self.held.items()
        if not items:
            return []
        try:
            states = self.store.steering.gate_calls([i.row.id for i in items])
        except DB_ERRORS as exc:
            self.health.error("stop check", exc)
            return []
        self.health.ok("stop check")
        hit = [i for i in items if i.abort_reason is None
               and getattr(states.get(i.row.id), "status", None) == "cancelled"]
        if not hit:
            return []
        # The reason first: the gate's stop cancels the task's coroutine on its loop, which
        # may end it before this thread goes on; a coroutine cancelled with no reason is
        # taken for the worker stopping, and its task was held for good.
        for item in hit:
            item.abort("cancelled")
            log.info("task cancelled: stopped", extra={"task_id": str(item.row.id)})
        if self.gate is not None:
            self.gate.stop([i.row.id for i in hit])
        self.stopped += len(hit)
        return hit

    def poke(self) -> None:
        """Check now (from any thread): a cancel was announced, or a lease was lost."""
        loop, poked = self._loop, self._poked
        if loop is not None and poked is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(poked.set)

    async def run(self) -> None:
        """Check every :attr:`interval` (or when poked) while tasks are held, until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._poked = asyncio.Event()
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._poked.wait(), self.interval)
                self._poked.clear()
                if self.held:
                    try:
                        await asyncio.to_thread(self.check_once)
                    except Exception as exc:  # never let the check die
                        self.health.error("stop check", exc)
        finally:
            self._loop = None
