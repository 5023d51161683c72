"""The watchdog (seed 003): fails tasks running past their ``budget_seconds``.

``run_once()`` moves every ``running`` task claimed more than ``budget_seconds`` ago to
``failed`` with ``error = 'timeout'`` and clears its lease token, so the late worker's
eventual completion matches no row and changes nothing. Its parent's fan-in follows in
the same transaction.

Options: ``batch_limit`` rows per pass. Failure modes: none of its own; concurrent
watchdogs skip each other's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.store import Store, TimedOut

WATCHDOG_BATCH_LIMIT = 1000


@dataclass(frozen=True)
class WatchdogConfig:
    """How the watchdog runs."""

    batch_limit: int = WATCHDOG_BATCH_LIMIT
    worker: str = "watchdog"

    def __post_init__(self) -> None:
        if self.batch_limit < 1:
            raise ValueError("batch_limit must be at least 1")


class Watchdog:
    """Times out tasks that ran past their budget."""

    def __init__(self, store: Store, config: WatchdogConfig | None = None) -> None:
        self.store = store
        self.config = config or WatchdogConfig()

    def run_once(self) -> TimedOut:
        """One pass; returns how many tasks it failed."""
        return self.store.time_out(worker=self.config.worker, limit=self.config.batch_limit)
