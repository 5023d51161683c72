"""What running a task decided, as the worker will write it: the engine's actions.

The executor turns a claimed task into one :data:`Action`; the worker writes it with one
guarded statement (batched with others): a run's outcome or a verdict (the store's
:class:`~runtime.store.rows.RunOutcome`, :class:`~runtime.store.rows.JudgeOutcome`), a
delegation, a retry of children, or nothing (:class:`Dropped`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from runtime.store.rows import ChildRow, JudgeOutcome, RunOutcome


@dataclass(frozen=True)
class DelegateAction:
    """Insert children and park the parent in ``waiting``."""

    task_id: uuid.UUID
    lease_token: uuid.UUID
    children: list[ChildRow]
    detail: str
    #: What ran (:attr:`runtime.store.rows.RunOutcome.stamp`).
    stamp: dict[str, Any] | None = None


@dataclass(frozen=True)
class RetryAction:
    """Send finished children back to pending; the parent waits again."""

    task_id: uuid.UUID
    lease_token: uuid.UUID
    child_ids: list[uuid.UUID]
    reassign_to: str | None
    detail: str


@dataclass(frozen=True)
class Dropped:
    """The task was taken away while it ran (lease lost): nothing to write."""

    task_id: uuid.UUID
    reason: str


Action = RunOutcome | JudgeOutcome | DelegateAction | RetryAction | Dropped
