"""What goes in and out of the store: requests, outcomes, what a pass did, and its errors."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

from runtime.config import Settings
from runtime.constants import (
    DEFAULT_BUDGET_SECONDS,
    DEFAULT_BUDGET_TOKENS,
    DEFAULT_BUDGET_USD,
    DEFAULT_TENANT,
)

# The agent that stands for a person (its tasks are questions no worker claims).
from runtime.constants import HUMAN_AGENT as HUMAN_AGENT
from runtime.core.canonical import canonical_json as canonical_json  # the store's modules
from runtime.core.canonical import canonical_sha256

# The records the model layer passes the store live in runtime/records.py (neither's);
# the store's modules name them from here too.
from runtime.records import ModelCharge as ModelCharge
from runtime.records import StepBegin as StepBegin
from runtime.records import StepEnd as StepEnd
from runtime.records import StepRecord as StepRecord

#: Every status a task can have; the CHECK constraint (models.py) and the code share this
#: tuple (kept here, not in models.py: reading it must not load the ORM).
STATUSES: tuple[str, ...] = (
    "pending", "running", "waiting", "ready_to_aggregate", "judging", "done", "failed",
    "escalated", "cancelled", "awaiting_approval",
)
#: Statuses that count as finished for fan-in (``cancelled`` counts as a failed child).
TERMINAL_STATUSES: tuple[str, ...] = ("done", "failed", "escalated", "cancelled")
#: Statuses a cancel ends: every one that is not terminal.
OPEN_STATUSES: tuple[str, ...] = tuple(s for s in STATUSES if s not in TERMINAL_STATUSES)


class IdempotencyConflict(ValueError):
    """The idempotency key is already used by a different request."""

    def __init__(self, key: str, task_id: uuid.UUID) -> None:
        super().__init__(f"idempotency key {key!r} is already used by task {task_id} "
                         "with a different request")
        self.key = key
        self.task_id = task_id


class ResolveRefused(ValueError):
    """A resolution that cannot be applied (task not escalated, parent already aggregated)."""


class NotFound(LookupError):
    """No task with that id."""


@dataclass(slots=True)
class TaskRow:
    """One ``tasks`` row as the engine holds it: typed, read from the database in one place.

    Every Store read that hands tasks to the engine (claims, a parent's children) builds
    them with :meth:`from_mapping`; public JSON views keep their mappings. ``get`` and
    ``[name]`` read a column by name, so code written against the old mapping rows (the
    model handle, the judge, tests) keeps working. A claim reads only the columns the
    engine uses (``fragment_claimed_columns`` in queries.sql): on a claimed row the
    timestamps of record, the lease owner and expiry and the roll-up marks keep their
    defaults.
    """

    id: uuid.UUID
    to_agent: str
    type: str
    payload: Any
    status: str
    parent_id: uuid.UUID | None = None
    root_id: uuid.UUID | None = None
    from_agent: str | None = None
    hypothesis_id: uuid.UUID | None = None
    success_criteria: dict[str, Any] | None = None
    kill_criteria: dict[str, Any] | None = None
    budget_tokens: int | None = DEFAULT_BUDGET_TOKENS
    budget_seconds: int | None = DEFAULT_BUDGET_SECONDS
    budget_usd: Decimal | None = DEFAULT_BUDGET_USD
    priority: int | None = 5
    created_at: dt.datetime | None = None
    started_at: dt.datetime | None = None
    completed_at: dt.datetime | None = None
    result: Any = None
    error: str | None = None
    depth: int = 0
    phase: str = "run"
    available_at: dt.datetime | None = None
    lease_owner: str | None = None
    lease_token: uuid.UUID | None = None
    lease_expires_at: dt.datetime | None = None
    claimed_at: dt.datetime | None = None
    deadline_at: dt.datetime | None = None
    delivery_count: int = 0
    retry_count: int = 0
    idempotency_key: str | None = None
    request_hash: str | None = None
    own_tokens: int = 0
    own_usd: Decimal = Decimal(0)
    spent_tokens: int = 0
    spent_usd: Decimal = Decimal(0)
    rolled_tokens: int = 0
    rolled_usd: Decimal = Decimal(0)
    duration_seconds: float = 0.0
    route: str | None = None
    route_reason: str | None = None
    model: str | None = None
    verdict: dict[str, Any] | None = None
    updated_at: dt.datetime | None = None
    #: Forks (migration 0007): the counterpart this task re-runs in the tree it came from
    #: (its recorded calls are replayed), and the model a fork set for its calls.
    forked_from: uuid.UUID | None = None
    model_override: str | None = None
    #: The tree's tenant (migration 0008): its share and limits (``[tenants.<name>]``).
    tenant: str = DEFAULT_TENANT
    claimed_from: str | None = None
    #: From a claim: whether a durable model reply of the claimed phase is on record
    #: (True when unknown: the model layer then looks replies up call by call).
    recorded_calls: bool = True
    #: From a claim, for a fork's branch task: its counterpart's successful replies of the
    #: claimed phase (``model_calls`` rows as dicts; None when not read with the claim).
    counterpart_calls: list[dict[str, Any]] | None = None

    @classmethod
    def from_mapping(cls, row: Mapping[Any, Any]) -> TaskRow:
        """Build a row from a result mapping; columns this type does not know are ignored."""
        return cls(**{k: v for k, v in row.items() if k in _TASK_FIELDS})

    @classmethod
    def from_rows(cls, keys: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[TaskRow]:
        """Build rows from one result's column names and value tuples.

        The same as :meth:`from_mapping` per row, with the known columns picked once per
        result instead of once per row (a claim of hundreds of tasks builds them on the
        worker's critical path).
        """
        picked = tuple((i, k) for i, k in enumerate(keys) if k in _TASK_FIELDS)
        build = _BUILDERS.get((len(keys), picked))
        if build is None:
            build = _BUILDERS[len(keys), picked] = _row_builder(len(keys), picked)
        return build(rows)

    @property
    def lease(self) -> uuid.UUID:
        """The lease token of a claimed row; a row nobody holds raises ``ValueError``."""
        if self.lease_token is None:
            raise ValueError(f"task {self.id} is not leased")
        return self.lease_token

    def get(self, name: str, default: Any = None) -> Any:
        """A column by name (``default`` when this type has no such column)."""
        return getattr(self, name, default) if name in _TASK_FIELDS else default

    def __getitem__(self, name: str) -> Any:
        if name not in _TASK_FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def replace(self, **changes: Any) -> TaskRow:
        """A copy with some columns changed (``TypeError`` for a column it does not have)."""
        unknown = changes.keys() - _TASK_FIELDS
        if unknown:
            raise TypeError(f"TaskRow has no column {sorted(unknown)[0]!r}")
        copy = _copy_row(self)
        for name, value in changes.items():
            setattr(copy, name, value)
        return copy

    def as_dict(self) -> dict[str, Any]:
        """Column name -> value."""
        return {name: getattr(self, name) for name in _TASK_FIELDS}


_TASK_FIELDS = frozenset(f.name for f in dataclasses.fields(TaskRow))
_RowBuilder = Callable[[Iterable[Sequence[Any]]], list[TaskRow]]
#: One builder per column set of a result (a claim's columns are always the same).
_BUILDERS: dict[tuple[int, tuple[tuple[int, str], ...]], _RowBuilder] = {}


#: From this many rows on, a result is built column by column (below, one row at a time).
_COLUMNWISE_FROM = 16


def _row_builder(width: int, picked: tuple[tuple[int, str], ...]) -> _RowBuilder:
    """A function that builds ``TaskRow``s from ``width``-long value tuples, ``picked`` known.

    Made once per column set: ``order`` (an ``itemgetter``) takes a row's values followed
    by the defaults of the fields the result lacks and puts them in the order of
    ``TaskRow``'s fields, which the dataclass ``__init__`` takes positionally. The
    ``__init__`` called with ~45 keyword arguments (a dict built per row) was the largest
    single cost of a claim's Python (py-spy, the no-op drain). A large result is turned
    into columns first (``zip``), so ``map`` calls ``TaskRow`` without a tuple per row. A
    result without a required column is built with keywords (``__init__`` then says what
    is missing).
    """
    at = {name: i for i, name in picked}
    fields = dataclasses.fields(TaskRow)
    if any(f.default is dataclasses.MISSING and f.name not in at for f in fields):
        return lambda rows: [TaskRow(**{k: v[i] for i, k in picked}) for v in rows]
    lacking = [f for f in fields if f.name not in at]
    defaults = tuple(f.default for f in lacking)  # immutable defaults: shared safely
    endless = tuple(repeat(value) for value in defaults)  # a default's column
    after = {f.name: width + j for j, f in enumerate(lacking)}  # after a row's values
    order = itemgetter(*(at[f.name] if f.name in at else after[f.name] for f in fields))

    def build(rows: Iterable[Sequence[Any]]) -> list[TaskRow]:
        batch = rows if isinstance(rows, list) else list(rows)
        if len(batch) < _COLUMNWISE_FROM:
            return [TaskRow(*order((*v, *defaults))) for v in batch]
        columns = (*zip(*batch, strict=True), *endless)
        return list(map(TaskRow, *order(columns)))

    return build


#: Every field of a ``TaskRow``, in ``__init__``'s order (a copy passes them positionally).
_every_column = attrgetter(*(f.name for f in dataclasses.fields(TaskRow)))


def _copy_row(row: TaskRow) -> TaskRow:
    """A shallow copy of a ``TaskRow`` (the inline judge copies every row)."""
    return TaskRow(*_every_column(row))


@dataclass(frozen=True)
class NewTask:
    """A root task to submit."""

    to_agent: str
    type: str
    payload: dict[str, Any]
    priority: int = 5
    budget_tokens: int = DEFAULT_BUDGET_TOKENS
    budget_seconds: int = DEFAULT_BUDGET_SECONDS
    budget_usd: Decimal = DEFAULT_BUDGET_USD
    success_criteria: dict[str, Any] | None = None
    kill_criteria: dict[str, Any] | None = None
    idempotency_key: str | None = None
    from_agent: str | None = None
    hypothesis_id: uuid.UUID | None = None
    tenant: str = DEFAULT_TENANT

    def request_hash(self) -> str:
        """A stable hash of everything that defines the request (idempotency conflicts)."""
        body = {
            "to_agent": self.to_agent,
            "type": self.type,
            "payload": self.payload,
            "priority": self.priority,
            "budget_tokens": self.budget_tokens,
            "budget_seconds": self.budget_seconds,
            "budget_usd": str(Decimal(self.budget_usd).normalize()),
            "success_criteria": self.success_criteria,
            "kill_criteria": self.kill_criteria,
        }
        if self.tenant != DEFAULT_TENANT:  # hashes of requests made before tenants hold
            body["tenant"] = self.tenant
        return canonical_sha256(body)


@dataclass(frozen=True)
class Tenancy:
    """What the store needs of ``[tenants.*]`` and ``[scheduler]`` (claims, delegation).

    Attributes:
        weights / caps / rates: weight (others 1), max_in_flight, tokens_per_minute.
        quantum_seconds / quantum_tokens: a step of fair time at weight 1; a tree's cost
            per call below which its step is one (``[scheduler]``).
        max_wait_seconds: no child's fair time is later than its creation plus this.

    """

    weights: Mapping[str, float] = field(default_factory=dict)
    caps: Mapping[str, int] = field(default_factory=dict)
    rates: Mapping[str, int] = field(default_factory=dict)
    quantum_seconds: float = 0.5
    max_wait_seconds: float = 300.0
    quantum_tokens: float = 1000.0

    @classmethod
    def from_settings(cls, settings: Settings) -> Tenancy:
        """The tenancy ``settings`` describe."""
        return cls(weights={n: t.weight for n, t in settings.tenants.items()},
                   caps={n: t.max_in_flight for n, t in settings.tenants.items()
                         if t.max_in_flight is not None},
                   rates={n: t.tokens_per_minute for n, t in settings.tenants.items()
                          if t.tokens_per_minute},
                   quantum_seconds=settings.scheduler.fair_quantum_seconds,
                   max_wait_seconds=settings.scheduler.max_wait_seconds,
                   quantum_tokens=settings.scheduler.fair_quantum_tokens)

    def claim_params(self) -> dict[str, Any]:
        """The claim's tenant parameters: capped (sorted) and metered tenants, their limits."""
        names, metered = sorted(self.caps), sorted(self.rates)
        return {"cap_tenants": names, "caps": [self.caps[n] for n in names],
                "bucket_tenants": metered, "bucket_rates": [self.rates[n] for n in metered]}

    def delegation_params(self) -> dict[str, Any]:
        """The delegation statement's fair-time parameters."""
        names = sorted(self.weights)
        return {"tenant_names": names, "tenant_weights": [self.weights[n] for n in names],
                "fair_quantum": self.quantum_seconds, "max_wait": self.max_wait_seconds}

    def charge_params(self) -> dict[str, Any]:
        """The charge statement's (a tree's cost per call sets its step)."""
        return {"fair_tokens": self.quantum_tokens, "max_wait": self.max_wait_seconds}


@dataclass(frozen=True)
class NewBranch:
    """A branch's root, ready to insert (built and validated by :mod:`runtime.forks`).

    Attributes:
        original: the original tree's root row (budgets, criteria, priority copied).
        to_agent / type / payload: the root's (overridden when the fork names the root).
        fork: what the fork changes: ``target`` (the task named), and optionally
            ``payload``, ``agent``, ``type``, ``model``, ``note``.
        model_override: the model of the root's calls (when the fork names the root).
        budget_tokens / budget_usd: the branch's budget (default: the original root's).
        agent_map: agents swapped wherever they are delegated to in the branch.

    """

    original: dict[str, Any]
    to_agent: str
    type: str
    payload: Any
    fork: dict[str, Any]
    model_override: str | None = None
    budget_tokens: int | None = None
    budget_usd: Decimal | None = None
    #: Agents swapped tree-wide (an experiment's variant): ``{delegated name: agent run}``.
    agent_map: dict[str, str] | None = None


@dataclass(frozen=True)
class ChildRow:
    """A child task to insert when a parent delegates (budgets already carved)."""

    to_agent: str
    type: str
    payload: dict[str, Any]
    key: str
    budget_tokens: int
    budget_seconds: int
    budget_usd: Decimal
    priority: int | None = None
    success_criteria: dict[str, Any] | None = None
    kill_criteria: dict[str, Any] | None = None


@dataclass(frozen=True)
class RunOutcome:
    """How a leased running task ends this delivery.

    ``to_status`` is ``judging`` (a result), ``failed``, ``escalated``, or ``pending``
    (a transient error: retried after ``delay_seconds``). With a ``verdict``, the result
    was judged inline and ``to_status`` is the judge's (``done``, ``failed``,
    ``escalated``): the task passes through ``judging`` in the same statement (two
    events), unless ``skips_judging`` (nothing to judge): one event, ``running -> done``.
    """

    task_id: uuid.UUID
    lease_token: uuid.UUID
    to_status: str
    result: Any = None
    error: str | None = None
    delay_seconds: float = 0.0
    detail: str | None = None
    verdict: dict[str, Any] | None = None
    #: What ran: ``{"version": the agent's version, "prompts": {name: hash}}`` (or None).
    stamp: dict[str, Any] | None = None
    skips_judging: bool = False


@dataclass(frozen=True)
class JudgeOutcome:
    """The judge stage's verdict on a leased judging task."""

    task_id: uuid.UUID
    lease_token: uuid.UUID
    to_status: str
    verdict: dict[str, Any]
    error: str | None = None
    detail: str | None = None


@dataclass(frozen=True)
class Reaped:
    """What one reaper pass did."""

    released: int = 0
    poisoned: int = 0
    ids: tuple[uuid.UUID, ...] = ()


@dataclass(frozen=True)
class TimedOut:
    """What one watchdog pass did."""

    failed: int = 0
    ids: tuple[uuid.UUID, ...] = ()


@dataclass(frozen=True)
class Swept:
    """What one fan-in sweep did."""

    ready: int = 0
    ids: tuple[uuid.UUID, ...] = ()


@dataclass
class Finished:
    """What a batch of completions did: ids applied, ids whose lease was gone, parents ready."""

    applied: list[uuid.UUID] = field(default_factory=list)
    stale: list[uuid.UUID] = field(default_factory=list)
    parents_ready: list[uuid.UUID] = field(default_factory=list)


#: How a hand-off's claim event ends (``task_events.detail``): the aggregate of a parent
#: whose last child this worker finished; a child this worker delegated.
HANDED_UP = "; handed up by its last child's finish"
HANDED_DOWN = "; handed down by its parent's delegation"


@dataclass
class Handoff:
    """Room a worker offers for the work its own writes make claimable (a hand-off).

    Passed to the store's writes that can make work claimable (finishing a parent's last
    child, delegating): in the same transaction, what this worker's next claim could take
    is leased to it (``task_claim_handed``), so it runs without a claim round trip. One
    offer may be passed to several writes in turn: each takes from ``room`` and adds what
    it leased to ``taken`` once its transaction committed.

    Attributes:
        agents: the agents the worker runs (a claim's ``agents``).
        room: how many more tasks it may take now.
        lease_seconds: the lease a claim would give.
        taken: the rows leased to it, typed as a claim's (the worker must run them).

    """

    agents: Sequence[str]
    room: int
    lease_seconds: float
    taken: list[TaskRow] = field(default_factory=list)

    def offered(self) -> bool:
        """Whether there is anything to take: agents and room."""
        return bool(self.agents) and self.room > 0

    def took(self, rows: Sequence[TaskRow]) -> None:
        """``rows`` were leased to the worker and committed: count them, keep them."""
        self.room -= len(rows)
        self.taken.extend(rows)

    def take_all(self) -> list[TaskRow]:
        """The rows taken so far, no longer kept here (the worker runs them)."""
        rows, self.taken = self.taken, []
        return rows


def served_totals(nodes: Iterable[tuple[Mapping[str, int] | None, bool | None, Any]]
                  ) -> dict[str, Any]:
    """A tree's totals of which backends served its calls, from each node's columns.

    Args:
        nodes: per task, its ``served_by`` (calls per backend), ``cost_estimated`` and
            ``own_usd`` (queries.sql ``fragment_task_served``).

    Returns:
        ``served_by``: calls per backend over the tree (None without calls);
        ``estimated_usd``: the part of the spend priced for a model that did not run.

    """
    served: Counter[str] = Counter()
    estimated = Decimal(0)
    for by, is_estimate, usd in nodes:
        served.update(by or {})
        if is_estimate:
            estimated += Decimal(usd or 0)
    return {"served_by": dict(sorted(served.items())) or None,
            "estimated_usd": f"{estimated:.8f}"}
