"""One tree run in this process: a worker that claims only that tree, until its root ends.

What ``orgchart run`` (and ``fork --run``) and ``orgchart.Client.run`` share:
:func:`run_tree` starts a worker on a thread of this process whose claims are limited to
the tree of one root (``WorkerConfig.root_ids``: ``task_claim_in_trees``), so a goal
that someone else submitted earlier and that still waits in the queue is never run, nor
paid for, here. It waits until the root ends, ``timeout`` passes, or the worker stops
(a signal), then stops the worker, which hands back what it still holds, and returns
the root's last status.

Options: ``timeout`` (seconds; None waits as long as it takes), ``max_in_flight`` (the
most tasks held at once), ``started`` (called with the worker before its thread starts:
the CLI installs its signal handlers there), ``tick`` (called while waiting, returns the
root's status: the CLI redraws its tree there; by default the root row is read, first
after :data:`FIRST_POLL_SECONDS`, then less often up to :data:`MAX_POLL_SECONDS`).

Failure modes: a root that is still open after ``timeout`` is returned with its status
(the caller says so); the worker's own errors are its (retried, counted in its stats).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runtime.core import backoff
from runtime.store.rows import TERMINAL_STATUSES

if TYPE_CHECKING:
    from runtime.wiring import Runtime

#: The first wait between two reads of the root, then doubled up to the most.
FIRST_POLL_SECONDS = 0.005
MAX_POLL_SECONDS = 0.1
#: The in-process worker's poll and maintenance intervals: one tree, a person waiting.
WORKER_POLL_SECONDS = 0.2
WORKER_MAINTENANCE_SECONDS = 0.5
#: How long a stopped worker gets to hand back what it holds.
JOIN_SECONDS = 30.0


def root_status(runtime: Runtime, root_id: uuid.UUID) -> str:
    """The root's status now (one read of its row)."""
    return str(runtime.store.reads.get(root_id)["status"])


def run_tree(runtime: Runtime, root_id: uuid.UUID, *, timeout: float | None = None,
             max_in_flight: int | None = None,
             started: Callable[[Any], None] | None = None,
             tick: Callable[[], str] | None = None) -> str:
    """Run the tree of ``root_id`` in this process until its root ends; return its status.

    Args:
        runtime: the configured parts (its store, agents and model backend).
        root_id: the root whose tree the worker claims (and nothing else).
        timeout: give up after this many seconds (the status is then an open one).
        max_in_flight: the most tasks held at once (default ``[worker] max_in_flight``).
        started: called with the worker before it starts (signal handlers, GC tuning).
        tick: called while waiting; returns the root's status (default: read the row,
            with a backoff).

    """
    from runtime.telemetry.traces import finish_tree_export

    worker = runtime.worker(root_ids=(root_id,), poll_interval_seconds=WORKER_POLL_SECONDS,
                            maintenance_interval_seconds=WORKER_MAINTENANCE_SECONDS,
                            max_in_flight=max_in_flight)
    if started is not None:
        started(worker)
    thread = threading.Thread(target=worker.run, name=f"worker {root_id}", daemon=True)
    thread.start()
    try:
        status = _wait(runtime, root_id, timeout, tick, thread)
    finally:
        worker.stop("run finished")
        thread.join(timeout=JOIN_SECONDS)
    finish_tree_export(root_id)  # the tree's spans go out now, not from an exit hook
    return status


def _wait(runtime: Runtime, root_id: uuid.UUID, timeout: float | None,
          tick: Callable[[], str] | None, thread: threading.Thread) -> str:
    """Wait for the root to end, the deadline, or the worker's thread to end."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pauses = backoff.delays(FIRST_POLL_SECONDS, MAX_POLL_SECONDS)
    while True:
        status = tick() if tick is not None else root_status(runtime, root_id)
        if (status in TERMINAL_STATUSES or not thread.is_alive()
                or (deadline is not None and time.monotonic() >= deadline)):
            return status
        time.sleep(next(pauses) if tick is None else WORKER_POLL_SECONDS)
