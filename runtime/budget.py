"""Budgets: the one place their rules and arithmetic live (pure: no database, no model).

A task's budget (``budget_tokens``, ``budget_usd``) covers its whole subtree. The rules,
each stated here once and referenced from the code and SQL that apply them:

1. **Carve** (:func:`carve`; the executor, when a parent delegates): children get their
   budgets out of what the parent has left (its budget minus its spend and the calls it
   has in flight). A child that names a budget gets it if all named budgets fit; the
   others share the rest evenly, one share kept back for the parent's own aggregate.
   Asking for more than is left, or for a negative amount, refuses the delegation.
   ``budget_seconds`` is wall-clock time per run: a child may not ask for more than its
   parent has; siblings run in parallel and do not divide it.
2. **Retry** (:func:`check_retry`; the executor, when an aggregate sends children back):
   the children's unspent budgets must fit in what the parent has left, or a retry would
   let the tree spend its parent's remainder twice (once by the aggregate, once by the
   children).
3. **Reserve** (:meth:`TaskBudget.reserve`; the model layer, before each request): the
   request's prompt tokens plus its completion cap must fit the task's budget minus its
   spend minus the requests in flight, in tokens and in money (priced with
   :func:`call_cost`, the function the charge uses). The completion cap shrinks to what
   fits; below :data:`MIN_COMPLETION_TOKENS` (or what was asked) the call is refused
   with ``BudgetExceeded`` and nothing is spent.
4. **Settle** (:meth:`TaskBudget.settle`; after the request): the reservation is released
   and the server's real counts are spent, exactly. The completion never exceeds its cap
   (the server stops there); the prompt is counted by the server, so the reservation
   uses an estimate of it, and when the server counts more, the difference is spent all
   the same (never hidden) and returned as the settlement's overrun.
5. **Charge** (SQL ``task_charge_running``, ``task_charge_running_many``): a request is
   charged to its own task only (``own_*`` and ``spent_*``), with :func:`call_cost`.
6. **Roll up** (:func:`unrolled`, :func:`sum_by_parent`; SQL ``task_roll_up_children``,
   or ``task_finish_running`` for the children a run's outcome ends, then
   ``task_add_children_spend``): when a child reaches a terminal status, what it spent
   since its last roll-up is added to its parent, in the transaction that locks the
   parent for fan-in. So a parent's ``spent_*`` includes its ended children's.
7. **Kill** (:func:`spend_hits`; the judge): a task whose subtree spent more than its
   ``max_tokens`` or ``max_cost_usd`` kill criterion is escalated.

Why a tree stays within its budget: every request is reserved against its own task's
remainder (3), children only receive what their parent has left (1, 2), and a child's
spend reaches its parent before the parent runs again (6). So the spend of a subtree
never exceeds its root's budget, under any interleaving of requests, as long as each
request spends no more than it reserved; the only excess possible is a settlement's
overrun, a server counting more prompt tokens than estimated (4).
``tests/unit/test_budget_properties.py`` checks this with random interleavings.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal
from typing import Any

from runtime.errors import BudgetExceeded

#: Costs are kept to the precision of the database's money columns (``numeric(16, 8)``).
USD_QUANTUM = Decimal("0.00000001")
#: A child's carved USD share is rounded down to the budget column's precision (4 places).
BUDGET_USD_QUANTUM = Decimal("0.0001")
#: A call is refused when fewer completion tokens than this (or than asked) fit the budget.
MIN_COMPLETION_TOKENS = 16

Money = Decimal


class BudgetRefused(ValueError):
    """A carve or a retry the budget rules refuse; the message starts with ``budget:``."""


def call_cost(tokens: int, price: Decimal) -> Decimal:
    """What ``tokens`` cost at ``price`` per token, at the money columns' precision."""
    return (tokens * price).quantize(USD_QUANTUM)


# ---------------------------------------------------------------------- carve (rule 1)
@dataclass(frozen=True)
class Ask:
    """What one child asks for (None: its share, or for seconds its parent's)."""

    key: str
    tokens: int | None = None
    usd: Decimal | None = None
    seconds: int | None = None


@dataclass(frozen=True)
class Grant:
    """The budget a child gets."""

    tokens: int
    usd: Decimal
    seconds: int


def _check_asks(asks: Sequence[Ask], parent_seconds: int) -> None:
    for ask in asks:
        for name, value in (("budget_tokens", ask.tokens), ("budget_seconds", ask.seconds),
                            ("budget_usd", ask.usd)):
            if value is not None and value < 0:
                raise BudgetRefused(f"budget: child {ask.key!r} asks for {name}={value}")
        if ask.seconds is not None and ask.seconds > parent_seconds:
            raise BudgetRefused(
                f"budget: child {ask.key!r} asks for {ask.seconds}s, more than its "
                f"parent's budget_seconds={parent_seconds}")


def carve(left_tokens: int, left_usd: Decimal, parent_seconds: int,
          asks: Sequence[Ask]) -> list[Grant]:
    """Children's budgets out of what their parent has left (rule 1), in ``asks`` order.

    Raises:
        BudgetRefused: a negative ask, more seconds than the parent's, or named budgets
            that together exceed what is left.

    """
    _check_asks(asks, parent_seconds)
    asked_tokens = sum(a.tokens or 0 for a in asks)
    asked_usd = sum((a.usd or Decimal(0) for a in asks), Decimal(0))
    if asked_tokens > left_tokens:
        raise BudgetRefused(
            f"budget: children ask for {asked_tokens} tokens but only {left_tokens} remain")
    if asked_usd > left_usd:
        raise BudgetRefused(f"budget: children ask for ${asked_usd} but only ${left_usd} "
                            "remains")
    shares = 1 + sum(1 for a in asks if a.tokens is None or a.usd is None)
    share_tokens = max(0, (left_tokens - asked_tokens) // shares)
    share_usd = max(Decimal(0), ((left_usd - asked_usd) / shares).quantize(
        BUDGET_USD_QUANTUM, rounding=ROUND_DOWN))
    return [Grant(tokens=a.tokens if a.tokens is not None else share_tokens,
                  usd=a.usd if a.usd is not None else share_usd,
                  seconds=a.seconds if a.seconds is not None else parent_seconds)
            for a in asks]


# ---------------------------------------------------------------------- retry (rule 2)
@dataclass(frozen=True)
class ChildSpend:
    """A child's budget and what it has spent (its subtree's spend)."""

    budget_tokens: int
    budget_usd: Decimal
    spent_tokens: int
    spent_usd: Decimal


def check_retry(left_tokens: int, left_usd: Decimal, children: Sequence[ChildSpend]) -> None:
    """Refuse a retry whose children could spend more than their parent has left (rule 2)."""
    need_tokens = sum(max(0, c.budget_tokens - c.spent_tokens) for c in children)
    need_usd = sum((max(Decimal(0), c.budget_usd - c.spent_usd) for c in children),
                   Decimal(0))
    if need_tokens > left_tokens:
        raise BudgetRefused(f"budget: retrying {len(children)} children leaves them "
                            f"{need_tokens} tokens but only {left_tokens} remain")
    if need_usd > left_usd:
        raise BudgetRefused(f"budget: retrying {len(children)} children leaves them "
                            f"${need_usd} but only ${left_usd} remains")


# ---------------------------------------------------------------------- reserve, settle
@dataclass(frozen=True)
class Reservation:
    """What one request holds of its task's budget while it is in flight (rule 3).

    Attributes:
        prompt_tokens: the prompt's estimated tokens.
        completion_tokens: the completion cap the request is sent with.
        usd: ``call_cost(prompt_tokens + completion_tokens, price)``.

    """

    prompt_tokens: int
    completion_tokens: int
    usd: Decimal

    @property
    def tokens(self) -> int:
        """Prompt plus completion tokens held."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Settlement:
    """A settled request: what it spent, and how much more than it reserved (rule 4)."""

    tokens: int
    usd: Decimal
    over_tokens: int
    over_usd: Decimal


class TaskBudget:
    """One task's budget while it runs: its spend so far and the requests in flight.

    Thread-safe: a task's parallel requests reserve and settle from any thread.

    Args:
        budget_tokens / budget_usd: the task's budget (its whole subtree's).
        spent_tokens / spent_usd: what the subtree spent before this run (the row's).
        task: names the task in refusals.

    """

    def __init__(self, budget_tokens: int, budget_usd: Decimal, spent_tokens: int = 0,
                 spent_usd: Decimal = Decimal(0), task: uuid.UUID | str = "") -> None:
        self.budget_tokens = int(budget_tokens)
        self.budget_usd = Decimal(budget_usd)
        self._spent_tokens = int(spent_tokens)
        self._spent_usd = Decimal(spent_usd)
        self._reserved_tokens = 0
        self._reserved_usd = Decimal(0)
        self.task = task
        self._lock = threading.Lock()

    @property
    def spent_tokens(self) -> int:
        """Tokens spent (settled), this run's and before."""
        return self._spent_tokens

    @property
    def spent_usd(self) -> Decimal:
        """USD spent (settled), this run's and before."""
        return self._spent_usd

    def remaining_tokens(self) -> int:
        """Tokens still free: budget minus spend minus the requests in flight."""
        with self._lock:
            return max(0, self.budget_tokens - self._spent_tokens - self._reserved_tokens)

    def remaining_usd(self) -> Decimal:
        """USD still free: budget minus spend minus the requests in flight."""
        with self._lock:
            return max(Decimal(0), self.budget_usd - self._spent_usd - self._reserved_usd)

    def reserve(self, prompt_tokens: int, asked: int, price: Decimal) -> Reservation:
        """Hold a request's tokens and cost, its completion cap shrunk to fit (rule 3).

        Raises:
            BudgetExceeded: fewer than ``min(MIN_COMPLETION_TOKENS, asked)`` completion
                tokens fit; nothing is held.

        """
        with self._lock:
            spent_tokens = self._spent_tokens + self._reserved_tokens
            spent_usd = self._spent_usd + self._reserved_usd
            token_room = self.budget_tokens - spent_tokens - prompt_tokens
            usd_room = self._usd_room(self.budget_usd - spent_usd, prompt_tokens, price, asked)
            allowed = min(asked, token_room, usd_room)
            needed = min(MIN_COMPLETION_TOKENS, asked)
            if allowed < needed:
                raise BudgetExceeded(self._refusal(prompt_tokens, needed, price, token_room,
                                                   usd_room, spent_tokens, spent_usd))
            held = Reservation(prompt_tokens, allowed, call_cost(prompt_tokens + allowed, price))
            self._reserved_tokens += held.tokens
            self._reserved_usd += held.usd
            return held

    @staticmethod
    def _usd_room(left: Decimal, prompt_tokens: int, price: Decimal, asked: int) -> int:
        """The most completion tokens whose call, priced by :func:`call_cost`, fits ``left``."""
        if price <= 0:
            return asked
        room = math.floor(left / price) - prompt_tokens
        while room > 0 and call_cost(prompt_tokens + room, price) > left:
            room -= 1  # rounding to the money columns' precision went up
        return room

    def _refusal(self, prompt_tokens: int, needed: int, price: Decimal, token_room: int,
                 usd_room: int, spent_tokens: int, spent_usd: Decimal) -> str:
        problems = []
        if token_room < needed:
            problems.append(
                f"it needs about {prompt_tokens} prompt + {needed} completion tokens but "
                f"{max(0, self.budget_tokens - spent_tokens)} of budget_tokens "
                f"{self.budget_tokens} are left (spent {spent_tokens})")
        if usd_room < needed:
            cost = call_cost(prompt_tokens + needed, price)
            problems.append(
                f"it would cost about ${cost} at ${price}/token but "
                f"${max(Decimal(0), self.budget_usd - spent_usd)} of budget_usd "
                f"${self.budget_usd} is left (spent ${spent_usd})")
        return f"budget: model call refused for task {self.task}: " + "; ".join(problems)

    def reserve_usd(self, usd: Decimal, what: str) -> Reservation:
        """Hold a tool's cost (USD, no tokens) before it runs (rule 3, for tools).

        Raises:
            BudgetExceeded: it does not fit what is left; nothing is held.

        """
        with self._lock:
            left = self.budget_usd - self._spent_usd - self._reserved_usd
            if usd > left:
                raise BudgetExceeded(
                    f"budget: {what} refused for task {self.task}: it costs ${usd} but "
                    f"${max(Decimal(0), left)} of budget_usd ${self.budget_usd} is left")
            self._reserved_usd += usd
            return Reservation(0, 0, usd)

    def settle(self, held: Reservation, tokens: int = 0,
               usd: Decimal = Decimal(0)) -> Settlement:
        """Release ``held`` and spend what the request really used (rule 4).

        ``tokens`` and ``usd`` are what was charged (zero when nothing was: a refused or
        cancelled request).
        """
        with self._lock:
            self._reserved_tokens -= held.tokens
            self._reserved_usd -= held.usd
            self._spent_tokens += tokens
            self._spent_usd += usd
        return Settlement(tokens, usd, tokens - held.tokens, usd - held.usd)


# ---------------------------------------------------------------------- roll-up (rule 6)
def unrolled(spent: int | Decimal, rolled: int | Decimal) -> int | Decimal:
    """What an ended child adds to its parent: its spend since its last roll-up."""
    return spent - rolled


def sum_by_parent(rows: Iterable[tuple[uuid.UUID, int, Decimal]]
                  ) -> dict[uuid.UUID, tuple[int, Decimal]]:
    """Add up ``(parent_id, tokens, usd)`` roll-ups per parent (one update per parent)."""
    totals: dict[uuid.UUID, tuple[int, Decimal]] = {}
    for parent, tokens, usd in rows:
        t, u = totals.get(parent, (0, Decimal(0)))
        totals[parent] = (t + int(tokens), u + Decimal(usd))
    return totals


# ---------------------------------------------------------------------- kill (rule 7)
def spend_hits(spent_tokens: int, spent_usd: Decimal,
               kill: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The spend kill criteria a subtree's spend is over, each with its limit and figure."""
    hits: list[dict[str, Any]] = []
    if "max_cost_usd" in kill:
        limit = Decimal(str(kill["max_cost_usd"]))
        if spent_usd > limit:
            hits.append({"criterion": "max_cost_usd", "limit": kill["max_cost_usd"],
                         "actual": str(spent_usd),
                         "reason": f"max_cost_usd: spent ${spent_usd} > limit ${limit}"})
    if "max_tokens" in kill and spent_tokens > kill["max_tokens"]:
        hits.append({"criterion": "max_tokens", "limit": kill["max_tokens"],
                     "actual": spent_tokens,
                     "reason": f"max_tokens: spent {spent_tokens} tokens > limit "
                               f"{kill['max_tokens']}"})
    return hits
