"""What agents see of tasks (:class:`TaskView`, :class:`ChildView`) and the budget defaults.

These types are shared by ``agents.base`` (the agent API) and ``agents.context`` (what an
agent runs with); they hold no database handle and no lease. The runtime builds them from
its typed rows (``runtime.store.rows.TaskRow``) or from any mapping of ``tasks`` columns.

The budget defaults are defined once, in :mod:`runtime.config` (the store needs them and
may not import ``agents``), and re-exported here for agents: a task submitted without a
budget gets :data:`DEFAULT_BUDGET_TOKENS` tokens, :data:`DEFAULT_BUDGET_SECONDS` seconds
and :data:`DEFAULT_BUDGET_USD` dollars for its whole subtree.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from runtime.config import DEFAULT_BUDGET_SECONDS, DEFAULT_BUDGET_TOKENS, DEFAULT_BUDGET_USD

__all__ = [
    "DEFAULT_BUDGET_SECONDS",
    "DEFAULT_BUDGET_TOKENS",
    "DEFAULT_BUDGET_USD",
    "DEFAULT_PRIORITY",
    "ChildView",
    "TaskColumns",
    "TaskView",
]

#: Priority of a task submitted without one (lower runs first).
DEFAULT_PRIORITY = 5


class TaskColumns(Protocol):
    """Anything that reads ``tasks`` columns by name (a mapping or ``TaskRow``)."""

    def get(self, name: str, default: Any = None) -> Any:
        """The column's value, or ``default``."""
        ...

    def __getitem__(self, name: str) -> Any:
        """The column's value; a missing column raises."""
        ...


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


@dataclass(frozen=True)
class TaskView:
    """What an agent (and a policy) sees of a task: no database handle, no lease."""

    id: uuid.UUID
    root_id: uuid.UUID
    parent_id: uuid.UUID | None
    agent: str
    type: str
    payload: dict[str, Any]
    depth: int
    priority: int
    budget_tokens: int
    budget_seconds: int
    budget_usd: Decimal
    spent_tokens: int = 0
    spent_usd: Decimal = Decimal(0)
    own_tokens: int = 0
    own_usd: Decimal = Decimal(0)
    phase: str = "run"
    attempt: int = 1
    from_agent: str | None = None
    success_criteria: dict[str, Any] | None = None
    kill_criteria: dict[str, Any] | None = None
    result: Any = None
    input: Any = None

    @classmethod
    def from_row(cls, row: TaskColumns | Mapping[str, Any], input_value: Any = None) -> TaskView:
        """Build a view from a ``tasks`` row (a ``TaskRow`` or a column mapping)."""
        if not isinstance(row, Mapping) and hasattr(row, "to_agent"):
            return cls._from_attributes(row, input_value)
        payload = row["payload"]
        return cls(
            id=row["id"],
            root_id=row["root_id"],
            parent_id=row.get("parent_id"),
            agent=row["to_agent"],
            type=row["type"],
            payload=payload if isinstance(payload, dict) else {},
            depth=int(row.get("depth") or 0),
            priority=int(_or(row.get("priority"), DEFAULT_PRIORITY)),
            budget_tokens=int(_or(row.get("budget_tokens"), DEFAULT_BUDGET_TOKENS)),
            budget_seconds=int(_or(row.get("budget_seconds"), DEFAULT_BUDGET_SECONDS)),
            budget_usd=Decimal(_or(row.get("budget_usd"), DEFAULT_BUDGET_USD)),
            spent_tokens=int(row.get("spent_tokens") or 0),
            spent_usd=Decimal(row.get("spent_usd") or 0),
            own_tokens=int(row.get("own_tokens") or 0),
            own_usd=Decimal(row.get("own_usd") or 0),
            phase=row.get("phase") or "run",
            attempt=int(row.get("delivery_count") or 1),
            from_agent=row.get("from_agent"),
            success_criteria=row.get("success_criteria"),
            kill_criteria=row.get("kill_criteria"),
            result=row.get("result"),
            input=input_value,
        )

    @classmethod
    def _from_attributes(cls, row: Any, input_value: Any) -> TaskView:
        """:meth:`from_row` for a ``TaskRow``: the same view, its columns read as attributes.

        A claim builds one view per task on the worker's hot path; reading 18 columns by
        name through ``TaskRow.get`` was a fifth of a no-op task's execution.
        """
        payload = row.payload
        return cls(
            id=row.id,
            root_id=row.root_id,
            parent_id=row.parent_id,
            agent=row.to_agent,
            type=row.type,
            payload=payload if isinstance(payload, dict) else {},
            depth=int(row.depth or 0),
            priority=int(_or(row.priority, DEFAULT_PRIORITY)),
            budget_tokens=int(_or(row.budget_tokens, DEFAULT_BUDGET_TOKENS)),
            budget_seconds=int(_or(row.budget_seconds, DEFAULT_BUDGET_SECONDS)),
            budget_usd=Decimal(_or(row.budget_usd, DEFAULT_BUDGET_USD)),
            spent_tokens=int(row.spent_tokens or 0),
            spent_usd=Decimal(row.spent_usd or 0),
            own_tokens=int(row.own_tokens or 0),
            own_usd=Decimal(row.own_usd or 0),
            phase=row.phase or "run",
            attempt=int(row.delivery_count or 1),
            from_agent=row.from_agent,
            success_criteria=row.success_criteria,
            kill_criteria=row.kill_criteria,
            result=row.result,
            input=input_value,
        )


@dataclass(frozen=True)
class ChildView:
    """A finished child, as ``aggregate`` sees it.

    ``retries`` counts how often the child went back to pending: transient-error retries
    and retries by its parent's ``aggregate`` alike (the task's ``retry_count``).
    """

    id: uuid.UUID
    agent: str
    type: str
    key: str | None
    status: str
    payload: dict[str, Any]
    result: Any
    error: str | None
    verdict: dict[str, Any] | None
    spent_tokens: int
    spent_usd: Decimal
    retries: int = 0

    @classmethod
    def from_row(cls, row: TaskColumns | Mapping[str, Any]) -> ChildView:
        """Build a view from a ``tasks`` row (a ``TaskRow`` or a column mapping)."""
        payload = row["payload"]
        return cls(
            id=row["id"], agent=row["to_agent"], type=row["type"],
            key=row.get("idempotency_key"), status=row["status"],
            payload=payload if isinstance(payload, dict) else {},
            result=row.get("result"), error=row.get("error"), verdict=row.get("verdict"),
            spent_tokens=int(row.get("spent_tokens") or 0),
            spent_usd=Decimal(row.get("spent_usd") or 0),
            retries=int(row.get("retry_count") or 0),
        )

    @property
    def ok(self) -> bool:
        """True when the child ended ``done``."""
        return self.status == "done"
