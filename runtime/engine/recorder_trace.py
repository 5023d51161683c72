"""The recorder process's trace, for measuring where a reply's time goes (issue 44).

Set ``RECORDER_TRACE_DIR`` to a directory and the recorder process
(:mod:`runtime.engine.recorder_process`) charges through a :class:`TracedWriter`: a line
of JSON per journal batch and per charge batch (when each of its replies was parsed,
when the batch started, sent its COMMIT and ended) and one per late wake-up of its event
loop, in ``rec-<pid>.jsonl``. ``python -m bench.recorder_lag`` reads them. Not for
production: a line is written and flushed per batch.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any

from sqlalchemy import event

from runtime.engine.charges import ChargeWriter
from runtime.records import ModelCharge
from runtime.store.store import Store

#: A loop's wake-up later than this is logged (``probe``).
LATE_SECONDS = 0.005


def trace_key(row: ModelCharge) -> tuple[Any, ...]:
    """A reply's key in the trace: its task and request."""
    return (row.task_id, row.phase, row.call_index, row.call_try, row.attempt_kind)


class TracedWriter(ChargeWriter):
    """A charge writer that logs its batches, the journal's and the loop's lag (module doc).

    Args:
        store: as :class:`ChargeWriter`'s.
        trace_dir: where ``rec-<pid>.jsonl`` is written.

    """

    def __init__(self, store: Store, trace_dir: str) -> None:
        #: When each reply was parsed (by :func:`trace_key`), set by the recorder.
        self.arrived: dict[tuple[Any, ...], float] = {}
        self._trace = open(os.path.join(trace_dir, f"rec-{os.getpid()}.jsonl"), "a")  # noqa: SIM115
        self._lock = threading.Lock()
        self._commit_at = threading.local()
        event.listen(store.engine, "commit",
                     lambda conn: setattr(self._commit_at, "t", time.time()))
        super().__init__(store)

    def _line(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._trace.write(json.dumps(record) + "\n")
            self._trace.flush()

    async def probe(self) -> None:
        """Log each time a 2 ms sleep of the loop wakes late, with the process's CPU then."""
        while True:
            at, cpu = time.time(), time.process_time()
            await asyncio.sleep(0.002)
            late = time.time() - at - 0.002
            if late > LATE_SECONDS:
                self._line({"probe": True, "at": at, "late": late,
                            "cpu": time.process_time() - cpu})

    def journaled(self, started: float, ended: float, batch: list[ModelCharge]) -> None:
        """One journal batch written (the journal's ``traced`` hook)."""
        self._line({"journal": True, "start": started, "end": ended,
                    "arr": [self.arrived.get(trace_key(c)) for c in batch]})

    def _write(self, batch: list[Any]) -> None:
        started = time.time()
        self._commit_at.t = None
        super()._write(batch)
        self._line({"lane": threading.current_thread().name, "start": started,
                    "commit": self._commit_at.t, "end": time.time(),
                    "arr": [self.arrived.get(trace_key(c)) for c, _ in batch]})
