"""The reaper: returns tasks whose lease expired to where they were claimed from.

A worker that dies (SIGKILL, OOM, lost machine) stops renewing its leases. Once a lease
expires, ``run_once()`` releases the task: ``pending`` for a run, ``ready_to_aggregate``
for an aggregate, an unleased ``judging`` for the judge stage. A task already delivered
``max_delivery`` times is poison and ends ``failed`` with an error that says so.

Options: ``max_delivery`` (``[retry] max_delivery``), ``batch_limit`` rows per pass.
Failure modes: none of its own; two reapers at once skip each other's rows (SKIP LOCKED),
and a heartbeat that lands first keeps its task (the expiry is re-checked in the UPDATE).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.store import Reaped, Store

REAP_BATCH_LIMIT = 1000


@dataclass(frozen=True)
class ReaperConfig:
    """How the reaper runs."""

    max_delivery: int = 3
    batch_limit: int = REAP_BATCH_LIMIT
    worker: str = "reaper"

    def __post_init__(self) -> None:
        if self.max_delivery < 1:
            raise ValueError("max_delivery must be at least 1")
        if self.batch_limit < 1:
            raise ValueError("batch_limit must be at least 1")


class Reaper:
    """Releases expired leases; poisons tasks past the delivery cap."""

    def __init__(self, store: Store, config: ReaperConfig) -> None:
        self.store = store
        self.config = config

    def run_once(self) -> Reaped:
        """One pass over expired leases; returns what it released and poisoned."""
        return self.store.reap(self.config.max_delivery, worker=self.config.worker,
                               limit=self.config.batch_limit)
