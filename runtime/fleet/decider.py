"""The decider: which agent modes a fire drains, and with how many workers.

A fire reads a :class:`Snapshot` of the queue (claimable work per agent, ``judge`` for
the judge stage), the open escalations and the status counts, and asks a decider for a
:class:`Plan`: an ordered list of :class:`Assignment` (mode, workers, task cap, wall
clock). The decider is pluggable: ``[orchestrator] decider = "module:Class"`` names any
class whose instances have ``plan(snapshot) -> Plan`` (see :class:`Decider`); it is built
with no arguments.

:class:`RuleBasedDecider`, the default, drains every mode with claimable work. Modes
next to an open escalation (the escalated task's agent or its parent's) and modes whose
oldest task is stale come first, oldest first; the rest follow by priority (lower is
more urgent), then age. Workers are shared out in proportion to queue size, at least one
per mode and never more than ``ceil(queued / task_cap)`` (a worker that would hit its
cap on an empty queue is waste); the total stays within ``max_workers`` whenever there
are no more modes than slots. With more modes than slots each mode gets one worker and
the orchestrator starts them as slots free up.

Whatever a decider returns, the orchestrator enforces the caps itself (it never runs more
than ``max_workers`` at once, and clamps each assignment's task cap and wall clock): the
limits are the safety interlock, not the decider's courtesy.
"""

from __future__ import annotations

import datetime as dt
import importlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from runtime.errors import BadInput

#: The queue entry for the judge stage (``judging`` tasks without a lease).
JUDGE_MODE = "judge"
#: Work older than this counts as stale and jumps the line.
STALE_AFTER_SECONDS = 3600.0


@dataclass(frozen=True)
class Limits:
    """The caps a plan must respect."""

    max_workers: int
    task_cap: int
    wall_clock_seconds: float

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        if self.task_cap < 1:
            raise ValueError("task_cap must be at least 1")
        if self.wall_clock_seconds <= 0:
            raise ValueError("wall_clock_seconds must be positive")


@dataclass(frozen=True)
class QueueEntry:
    """Claimable work for one mode."""

    mode: str
    queued: int
    top_priority: int
    oldest: dt.datetime


@dataclass(frozen=True)
class OpenEscalation:
    """One task waiting for a person."""

    task_id: str
    agent: str
    parent_agent: str | None
    error: str | None
    escalated_at: dt.datetime | None


@dataclass(frozen=True)
class Snapshot:
    """What the decider sees: the queue, the escalations, the status table, the caps."""

    queue: tuple[QueueEntry, ...]
    escalations: tuple[OpenEscalation, ...]
    by_status: Mapping[str, int]
    limits: Limits
    taken_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))

    @classmethod
    def from_rows(cls, queue_rows: Iterable[Mapping[str, Any]],
                  escalation_rows: Iterable[Mapping[str, Any]],
                  status_rows: Iterable[Mapping[str, Any]], limits: Limits,
                  taken_at: dt.datetime | None = None) -> Snapshot:
        """Build a snapshot from the store's rows (``queue()``, ``escalations()``, counts).

        Rows for the same mode are merged (a pending task addressed to an agent named
        ``judge`` and the judge stage share one entry).
        """
        merged: dict[str, QueueEntry] = {}
        for row in queue_rows:
            mode, n = str(row["to_agent"]), int(row["n"])
            if n <= 0:
                continue
            entry = QueueEntry(mode, n, int(row["top_priority"]), row["oldest"])
            old = merged.get(mode)
            if old is not None:
                entry = QueueEntry(mode, old.queued + n, min(old.top_priority, entry.top_priority),
                                   min(old.oldest, entry.oldest))
            merged[mode] = entry
        escalations = tuple(
            OpenEscalation(str(r["id"]), str(r["to_agent"]), r.get("from_agent"), r.get("error"),
                           r.get("escalated_at") or r.get("completed_at"))
            for r in escalation_rows
        )
        by_status = {str(r["status"]): int(r["n"]) for r in status_rows}
        return cls(tuple(merged.values()), escalations, by_status, limits,
                   taken_at or dt.datetime.now(dt.UTC))


@dataclass(frozen=True)
class Assignment:
    """Drain one mode with ``workers`` disposable workers, each capped."""

    mode: str
    workers: int
    task_cap: int
    wall_clock_seconds: float
    queued: int = 0
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.mode:
            raise ValueError("an assignment needs a mode")
        if self.workers < 1 or self.task_cap < 1 or self.wall_clock_seconds <= 0:
            raise ValueError(f"assignment for {self.mode!r}: workers and task_cap must be at "
                             "least 1 and the wall clock positive")

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        return {"mode": self.mode, "workers": self.workers, "task_cap": self.task_cap,
                "wall_clock_seconds": self.wall_clock_seconds, "queued": self.queued,
                "reason": self.reason}


@dataclass(frozen=True)
class Plan:
    """Modes to drain, most important first."""

    assignments: tuple[Assignment, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def modes(self) -> list[str]:
        """The modes in order."""
        return [a.mode for a in self.assignments]

    @property
    def workers(self) -> int:
        """Workers planned in total (started at most ``max_workers`` at a time)."""
        return sum(a.workers for a in self.assignments)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        return {"assignments": [a.as_dict() for a in self.assignments],
                "notes": list(self.notes)}

    def describe(self) -> str:
        """One line per assignment, for people."""
        if not self.assignments:
            return "nothing to drain"
        return "\n".join(
            f"{a.mode}: {a.workers} worker{'s' if a.workers != 1 else ''} for {a.queued} "
            f"queued (cap {a.task_cap} tasks, {a.wall_clock_seconds:g}s)"
            + (f" - {a.reason}" if a.reason else "")
            for a in self.assignments
        )


@runtime_checkable
class Decider(Protocol):
    """Anything with ``plan(snapshot) -> Plan``."""

    def plan(self, snapshot: Snapshot) -> Plan:
        """Decide which modes to drain and with how many workers."""
        ...


class RuleBasedDecider:
    """The default decider: escalation-adjacent and stale work first, then by priority."""

    def __init__(self, stale_after_seconds: float = STALE_AFTER_SECONDS) -> None:
        if stale_after_seconds <= 0:
            raise ValueError("stale_after_seconds must be positive")
        self.stale_after_seconds = stale_after_seconds

    def plan(self, snapshot: Snapshot) -> Plan:
        """Order the modes with work and share the workers out; see the module docstring."""
        limits = snapshot.limits
        adjacent = {e.agent for e in snapshot.escalations} | {
            e.parent_agent for e in snapshot.escalations if e.parent_agent}
        stale_before = snapshot.taken_at - dt.timedelta(seconds=self.stale_after_seconds)

        def reason(q: QueueEntry) -> str:
            why = []
            if q.mode in adjacent:
                why.append("next to an open escalation")
            if q.oldest < stale_before:
                why.append("stale work")
            return ", ".join(why)

        def key(q: QueueEntry) -> tuple[Any, ...]:
            urgent = q.mode in adjacent or q.oldest < stale_before
            if urgent:
                return (0, q.oldest, q.top_priority, q.mode)
            return (1, q.top_priority, q.oldest, q.mode)

        entries = sorted((q for q in snapshot.queue if q.queued > 0), key=key)
        counts = share_workers([q.queued for q in entries], limits.max_workers, limits.task_cap)
        assignments = tuple(
            Assignment(q.mode, n, limits.task_cap, limits.wall_clock_seconds, q.queued, reason(q))
            for q, n in zip(entries, counts, strict=True)
        )
        notes: tuple[str, ...] = ()
        if len(entries) > limits.max_workers:
            notes = (f"{len(entries)} modes for {limits.max_workers} slots: later modes start "
                     "as earlier workers exit",)
        return Plan(assignments, notes)


def share_workers(queued: list[int], max_workers: int, task_cap: int) -> list[int]:
    """Share ``max_workers`` across queues in proportion to their size.

    Each queue gets at least one worker and at most ``ceil(queued / task_cap)``; with more
    queues than workers, each gets one. Remainders go to the largest fractional shares
    (ties to the earlier, more important queue).

    Example:
        >>> share_workers([90, 10], 4, 10)
        [3, 1]

    """
    if not queued:
        return []
    if len(queued) >= max_workers:
        return [1] * len(queued)
    need = [max(1, math.ceil(n / task_cap)) for n in queued]
    counts = [1] * len(queued)
    spare = max_workers - len(queued)
    total = sum(queued)
    while spare > 0:
        # Next worker goes where the proportional share is furthest above what it has.
        best, best_gap = -1, 0.0
        for i, n in enumerate(queued):
            if counts[i] >= need[i]:
                continue
            gap = n / total * max_workers - counts[i]
            if best < 0 or gap > best_gap:
                best, best_gap = i, gap
        if best < 0:
            break  # every queue has as many workers as its backlog can use
        counts[best] += 1
        spare -= 1
    return counts


def load_decider(spec: str) -> Decider:
    """Import and build the decider named ``module:Class`` (``[orchestrator] decider``).

    Raises:
        BadInput: the name is malformed, the module or class cannot be found, or the
            class has no ``plan`` method.

    """
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise BadInput(f"[orchestrator] decider {spec!r} must look like 'module:Class' "
                       "(e.g. 'runtime.fleet.decider:RuleBasedDecider')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BadInput(f"[orchestrator] decider: cannot import {module_name!r}: {exc}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise BadInput(f"[orchestrator] decider: module {module_name!r} has no {class_name!r}")
    decider = cls()
    if not isinstance(decider, Decider):
        raise BadInput(f"[orchestrator] decider {spec!r} has no plan(snapshot) method")
    return decider
