"""The fan-in sweeper (seed 003): marks parents ``ready_to_aggregate``.

A parent that delegated waits in ``waiting``. When its last child finishes, the
completing transaction flips the parent at once (``Store._fan_in``); ``run_once()`` is
the safety net for anything that path missed (a crash between statements, a child
finished by hand), set-based, in one statement backed by the partial index on
``waiting`` rows and the ``(parent_id, status)`` index.

Options: ``batch_limit`` parents per pass. Failure modes: none of its own; concurrent
sweepers skip each other's rows and the UPDATE re-checks ``status = 'waiting'``.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.store import Store, Swept

SWEEP_INTERVAL_SECONDS = 1.0
SWEEP_BATCH_LIMIT = 10_000


@dataclass(frozen=True)
class SweeperConfig:
    """How the sweeper runs."""

    batch_limit: int = SWEEP_BATCH_LIMIT
    worker: str = "sweeper"

    def __post_init__(self) -> None:
        if self.batch_limit < 1:
            raise ValueError("batch_limit must be at least 1")


class Sweeper:
    """Flips waiting parents whose children are all terminal."""

    def __init__(self, store: Store, config: SweeperConfig | None = None) -> None:
        self.store = store
        self.config = config or SweeperConfig()

    def run_once(self) -> Swept:
        """One sweep; returns how many parents became ready."""
        return self.store.sweep(worker=self.config.worker, limit=self.config.batch_limit)
