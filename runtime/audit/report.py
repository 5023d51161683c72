"""What the audit found: violations with their evidence, and what it checked.

A :class:`Violation` names its promise (one of :data:`CHECKS`), the task or operation it
concerns, one line saying what is wrong, and its evidence: the smallest set of events,
calls, steps and client operations that shows it, each a plain dict (JSON-ready).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

#: The promises, in the order of issue 40 (docs/architecture.md lists them).
CHECKS: tuple[str, ...] = (
    "submits",      # 1. an acknowledged submit has its root exactly once
    "paths",        # 2. each task's events form a legal path; fan-in after its children
    "steering",     # 3. nothing claimed or called after a cancel or during a pause
    "duplicates",   # 4. paid or run twice only across a fault, never once durable
    "budgets",      # 5. no prefix of a tree's charges past its budget; carves fit
    "answers",      # 6. an acknowledged answer or approval applied once; a refused one never
    "fencing",      # 7. every accepted write carries its delivery's lease token
)


def plain(value: Any) -> Any:
    """``value`` with ids, times and decimals as JSON-ready strings and floats."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    return value


@dataclass(frozen=True)
class Violation:
    """One broken promise and the evidence that shows it.

    Attributes:
        check: which promise (one of :data:`CHECKS`).
        subject: the task (or operation) it concerns.
        message: one line saying what is wrong.
        evidence: the events, calls, steps or client operations that show it.

    """

    check: str
    subject: str
    message: str
    evidence: tuple[dict[str, Any], ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The violation as a JSON-ready dict."""
        return {"check": self.check, "subject": self.subject, "message": self.message,
                "evidence": plain(list(self.evidence))}


@dataclass
class Report:
    """Everything one audit found and counted.

    Attributes:
        violations: every broken promise found.
        in_flight: calls and steps allowed only because they were in flight at a cancel,
            a pause or a fault (listed, not violations).
        checked: how many of each thing were read (trees, tasks, events, calls, steps,
            operations, faults).

    """

    violations: list[Violation] = field(default_factory=list)
    in_flight: list[dict[str, Any]] = field(default_factory=list)
    checked: Counter[str] = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        """Whether no promise was broken."""
        return not self.violations

    def add(self, check: str, subject: Any, message: str, *evidence: dict[str, Any]) -> None:
        """Record one violation (see :class:`Violation`)."""
        self.violations.append(Violation(check, str(subject), message, tuple(evidence)))

    def of(self, check: str) -> list[Violation]:
        """The violations of one promise."""
        return [v for v in self.violations if v.check == check]

    def as_json(self) -> dict[str, Any]:
        """The report as a JSON-ready dict (what ``orgchart audit --json`` prints)."""
        return {"ok": self.ok, "checked": dict(self.checked),
                "violations": [v.as_json() for v in self.violations],
                "in_flight": plain(self.in_flight)}

    def text(self) -> str:
        """The report for a person: one block per violation, then the counts."""
        lines = []
        for v in self.violations:
            lines.append(f"VIOLATION [{v.check}] {v.subject}: {v.message}")
            lines.extend(f"    {plain(e)}" for e in v.evidence)
        counts = ", ".join(f"{n} {what}" for what, n in sorted(self.checked.items()))
        lines.append(f"checked: {counts or 'nothing'}")
        if self.in_flight:
            lines.append(f"allowed as in flight at a cancel, pause or fault: {len(self.in_flight)}")
        lines.append(f"{len(self.violations)} violation(s)" if self.violations
                     else "no violations")
        return "\n".join(lines)
