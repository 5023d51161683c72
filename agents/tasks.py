"""What agents see of tasks (:class:`TaskView`, :class:`ChildView`) and the budget defaults.

These types are shared by ``agents.base`` (the agent API) and ``agents.context`` (what an
agent runs with); they hold no database handle and no lease. The runtime builds them from
its typed rows (``runtime.store.rows.TaskRow``) or from any mapping of ``tasks`` columns.

The budget defaults are defined once, in :mod:`runtime.constants` (the store needs them and
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

from runtime.constants import DEFAULT_BUDGET_SECONDS, DEFAULT_BUDGET_TOKENS, DEFAULT_BUDGET_USD

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
        """Build a view from a ``tasks`` row (a ``TaskRow`` or a column mapping).

        A ``TaskRow``'s columns are read as its attributes: a claim builds one view per task
        on the worker's hot path, and reading 18 columns by name through ``TaskRow.get``
        was a fifth of a no-op task's execution. Anything else is read by name.
        """
        col: Any = row if not isinstance(row, Mapping) and hasattr(row, "to_agent") \
            else _ByName(row)
        payload = col.payload
        # Every field set at once, past the frozen dataclass's __init__ (a setattr call a
        # field, 21 of them: half of this method's time, once per claimed task).
        # test_task_view pins that this builds what the constructor builds.
        view = object.__new__(cls)
        view.__dict__.update(
            id=col.id,
            root_id=col.root_id,
            parent_id=col.parent_id,
            agent=col.to_agent,
            type=col.type,
            payload=payload if isinstance(payload, dict) else {},
            depth=int(col.depth or 0),
            priority=int(_or(col.priority, DEFAULT_PRIORITY)),
            budget_tokens=int(_or(col.budget_tokens, DEFAULT_BUDGET_TOKENS)),
            budget_seconds=int(_or(col.budget_seconds, DEFAULT_BUDGET_SECONDS)),
            budget_usd=Decimal(_or(col.budget_usd, DEFAULT_BUDGET_USD)),
            spent_tokens=int(col.spent_tokens or 0),
            spent_usd=Decimal(col.spent_usd or 0),
            own_tokens=int(col.own_tokens or 0),
            own_usd=Decimal(col.own_usd or 0),
            phase=col.phase or "run",
            attempt=int(col.delivery_count or 1),
            from_agent=col.from_agent,
            success_criteria=col.success_criteria,
            kill_criteria=col.kill_criteria,
            result=col.result,
            input=input_value,
        )
        return view


class _ByName:
    """Columns of a mapping (or any ``TaskColumns``) read as attributes, for ``from_row``.

    The columns a view cannot do without raise ``KeyError`` when missing; the others read
    as None.
    """

    __slots__ = ("_row",)
    _REQUIRED = frozenset({"id", "root_id", "to_agent", "type", "payload"})

    def __init__(self, row: TaskColumns | Mapping[str, Any]) -> None:
        self._row = row

    def __getattr__(self, name: str) -> Any:
        return self._row[name] if name in self._REQUIRED else self._row.get(name)


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
