"""The budget rules of runtime/budget.py, driven in random orders (hypothesis).

A state machine grows a tree the way the runtime does: tasks reserve and settle model
requests in any interleaving, a running task delegates (carve), a task ends and its spend
rolls up to its parent, a parent whose children all ended aggregates, and an aggregate
may send ended children back (retry). After every step:

- no subtree has spent, with its requests in flight, more than its root's budget (tokens
  and USD);
- every task's spend is its own requests' plus what its ended children rolled up;
- a running task's budget object agrees with its row.

Requests spend what the server reports; the prompt is counted as it was reserved (the
same counting) and the completion stops at its cap, as a server's does. A server that
counts more prompt tokens than reserved is the one excess the rules allow: the last test
checks that it is settled exactly, never hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime.budget import (
    MIN_COMPLETION_TOKENS,
    Ask,
    BudgetRefused,
    ChildSpend,
    Reservation,
    TaskBudget,
    call_cost,
    carve,
    check_retry,
    sum_by_parent,
    unrolled,
)
from runtime.errors import BudgetExceeded

#: Per-token prices, including one finer than the money columns (rounding matters).
PRICES = [Decimal(0), Decimal("0.000002"), Decimal("0.0000015"), Decimal("0.000000125"),
          Decimal("0.00003")]
SECONDS = 300

#: Small amounts as often as large ones: the edges (nothing left, one token) matter most.
token_amounts = st.one_of(st.integers(0, 100), st.integers(0, 2_000), st.integers(0, 200_000))
usd_amounts = st.one_of(st.integers(0, 100), st.integers(0, 50_000)).map(
    lambda n: Decimal(n) / 10_000)  # numeric(10, 4)
asks = st.lists(st.tuples(st.one_of(st.none(), token_amounts), st.one_of(st.none(), usd_amounts)),
                min_size=1, max_size=4)


@dataclass(eq=False)
class Node:
    """One task: its row's budget and spend, and (while it runs) its budget object."""

    parent: Node | None
    budget_tokens: int
    budget_usd: Decimal
    spent_tokens: int = 0
    spent_usd: Decimal = Decimal(0)
    rolled_tokens: int = 0
    rolled_usd: Decimal = Decimal(0)
    own_tokens: int = 0
    own_usd: Decimal = Decimal(0)
    state: str = "running"  # running, waiting, ended
    phase: str = "run"  # run, aggregate
    live: TaskBudget | None = None
    in_flight: list[tuple[Reservation, Decimal]] = field(default_factory=list)
    children: list[Node] = field(default_factory=list)

    def start(self) -> None:
        self.state = "running"
        self.live = TaskBudget(self.budget_tokens, self.budget_usd, self.spent_tokens,
                               self.spent_usd)

    def subtree(self) -> list[Node]:
        return [self, *(n for c in self.children for n in c.subtree())]


class BudgetMachine(RuleBasedStateMachine):
    """Reserve, settle, carve, end, roll up, aggregate and retry, in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[Node] = []

    @initialize(tokens=token_amounts, usd=usd_amounts)
    def submit_root(self, tokens: int, usd: Decimal) -> None:
        root = Node(None, tokens, usd)
        root.start()
        self.nodes.append(root)

    @precondition(lambda self: all(n.state == "ended" for n in self.nodes))
    @rule(tokens=token_amounts, usd=usd_amounts)
    def submit_another_root(self, tokens: int, usd: Decimal) -> None:
        self.submit_root(tokens, usd)

    def _running(self, idle: bool = False) -> list[Node]:
        return [n for n in self.nodes if n.state == "running" and not (idle and n.in_flight)]

    # ------------------------------------------------------------------ requests
    @precondition(lambda self: any(n.state == "running" for n in self.nodes))
    @rule(data=st.data(), prompt=st.one_of(st.integers(0, 50), st.integers(0, 3_000)),
          asked=st.one_of(st.integers(1, 50), st.integers(1, 5_000)),
          price=st.sampled_from(PRICES))
    def reserve(self, data: st.DataObject, prompt: int, asked: int, price: Decimal) -> None:
        node = data.draw(st.sampled_from(self._running()))
        assert node.live is not None
        before = (node.live.remaining_tokens(), node.live.remaining_usd())
        try:
            held = node.live.reserve(prompt, asked, price)
        except BudgetExceeded as exc:
            assert str(exc).startswith("budget:")
            assert (node.live.remaining_tokens(), node.live.remaining_usd()) == before
            return
        assert min(MIN_COMPLETION_TOKENS, asked) <= held.completion_tokens <= asked
        assert held.usd == call_cost(held.tokens, price)
        node.in_flight.append((held, price))

    @precondition(lambda self: any(n.in_flight for n in self.nodes))
    @rule(data=st.data(), used=st.integers(0, 100), answered=st.booleans())
    def settle(self, data: st.DataObject, used: int, answered: bool) -> None:
        node = data.draw(st.sampled_from([n for n in self.nodes if n.in_flight]))
        held, price = node.in_flight.pop(data.draw(st.integers(0, len(node.in_flight) - 1)))
        # The server counts the prompt as reserved; the completion stops at its cap. A
        # request that failed before the server answered is charged nothing.
        tokens = held.prompt_tokens + held.completion_tokens * used // 100 if answered else 0
        cost = call_cost(tokens, price)
        assert node.live is not None
        settled = node.live.settle(held, tokens, cost)
        assert settled.over_tokens <= 0 and settled.over_usd <= 0
        node.spent_tokens += tokens  # the charge (rule 5): the task's own row only
        node.spent_usd += cost
        node.own_tokens += tokens
        node.own_usd += cost

    # ------------------------------------------------------------------ the tree
    @precondition(lambda self: any(n.phase == "run" and not n.children and not n.in_flight
                                   and n.state == "running" for n in self.nodes))
    @rule(data=st.data(), wanted=asks)
    def delegate(self, data: st.DataObject, wanted: list[tuple[int | None, Decimal | None]]
                 ) -> None:
        parent = data.draw(st.sampled_from(
            [n for n in self._running(idle=True) if n.phase == "run" and not n.children]))
        assert parent.live is not None
        left_tokens, left_usd = parent.live.remaining_tokens(), parent.live.remaining_usd()
        try:
            grants = carve(left_tokens, left_usd, SECONDS,
                           [Ask(str(i), t, u) for i, (t, u) in enumerate(wanted)])
        except BudgetRefused as exc:
            assert str(exc).startswith("budget:")
            assert (sum(t or 0 for t, _ in wanted) > left_tokens
                    or sum((u or Decimal(0) for _, u in wanted), Decimal(0)) > left_usd)
            return
        assert sum(g.tokens for g in grants) <= left_tokens
        assert sum(g.usd for g in grants) <= left_usd
        for (tokens, usd), grant in zip(wanted, grants, strict=True):
            assert grant.tokens >= 0 and grant.usd >= 0 and grant.seconds == SECONDS
            assert tokens is None or grant.tokens == tokens
            assert usd is None or grant.usd == usd
        for grant in grants:
            child = Node(parent, grant.tokens, grant.usd)
            child.start()
            parent.children.append(child)
            self.nodes.append(child)
        parent.state, parent.live = "waiting", None

    @precondition(lambda self: any(
        n.state == "running" and not n.in_flight and (n.phase == "aggregate" or not n.children)
        for n in self.nodes))
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from([n for n in self._running(idle=True)
                                          if n.phase == "aggregate" or not n.children]))
        node.state, node.live = "ended", None
        parent = node.parent
        if parent is None:
            return
        # Rule 6: the spend since the last roll-up goes to the parent, in the transaction
        # that locks the parent for fan-in.
        rolls = [(id(parent), unrolled(node.spent_tokens, node.rolled_tokens),
                  unrolled(node.spent_usd, node.rolled_usd))]
        tokens, usd = sum_by_parent(rolls)[id(parent)]  # type: ignore[index]
        parent.spent_tokens += tokens
        parent.spent_usd += usd
        node.rolled_tokens, node.rolled_usd = node.spent_tokens, node.spent_usd
        if parent.state == "waiting" and all(c.state == "ended" for c in parent.children):
            parent.phase = "aggregate"
            parent.start()

    @precondition(lambda self: any(n.phase == "aggregate" and n.state == "running"
                                   and not n.in_flight for n in self.nodes))
    @rule(data=st.data())
    def retry_children(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(
            [n for n in self._running(idle=True) if n.phase == "aggregate"]))
        retried = data.draw(st.lists(st.sampled_from(parent.children), min_size=1,
                                     unique_by=id))
        assert parent.live is not None
        try:
            check_retry(parent.live.remaining_tokens(), parent.live.remaining_usd(), [
                ChildSpend(c.budget_tokens, c.budget_usd, c.spent_tokens, c.spent_usd)
                for c in retried])
        except BudgetRefused as exc:
            assert str(exc).startswith("budget:")
            return
        parent.state, parent.live = "waiting", None
        for child in retried:
            child.phase = "run" if not child.children else "aggregate"
            child.start()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def no_subtree_spends_more_than_its_budget(self) -> None:
        for node in self.nodes:
            tree = node.subtree()
            held = [h for n in tree for h, _ in n.in_flight]
            assert sum(n.own_tokens for n in tree) + sum(h.tokens for h in held) \
                <= node.budget_tokens
            assert sum((n.own_usd for n in tree), Decimal(0)) \
                + sum((h.usd for h in held), Decimal(0)) <= node.budget_usd

    @invariant()
    def spend_is_own_plus_rolled_up(self) -> None:
        for node in self.nodes:
            assert node.spent_tokens == node.own_tokens + sum(c.rolled_tokens
                                                             for c in node.children)
            assert node.spent_usd == node.own_usd + sum((c.rolled_usd for c in node.children),
                                                        Decimal(0))

    @invariant()
    def a_running_budget_agrees_with_its_row(self) -> None:
        for node in self.nodes:
            if node.live is not None:
                assert (node.live.spent_tokens, node.live.spent_usd) == \
                    (node.spent_tokens, node.spent_usd)


BudgetMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30,
                                           deadline=None)
TestBudgetRules = BudgetMachine.TestCase


@given(left_tokens=st.one_of(st.integers(-100, 0), token_amounts), left_usd=usd_amounts,
       wanted=asks)
def test_carving_never_hands_children_more_than_the_parent_has(
        left_tokens: int, left_usd: Decimal,
        wanted: list[tuple[int | None, Decimal | None]]) -> None:
    try:
        grants = carve(left_tokens, left_usd, SECONDS,
                       [Ask(str(i), t, u) for i, (t, u) in enumerate(wanted)])
    except BudgetRefused:
        return
    assert sum(g.tokens for g in grants) <= max(left_tokens, 0)
    assert sum(g.usd for g in grants) <= left_usd
    assert all(g.tokens >= 0 and g.usd >= 0 for g in grants)


@given(budget=st.integers(0, 10_000), prompt=st.integers(0, 2_000),
       counted=st.integers(0, 4_000), price=st.sampled_from(PRICES))
def test_a_server_that_counts_more_prompt_tokens_is_settled_exactly(
        budget: int, prompt: int, counted: int, price: Decimal) -> None:
    account = TaskBudget(budget, Decimal(1000))
    try:
        held = account.reserve(prompt, 200, price)
    except BudgetExceeded:
        return
    tokens = counted + held.completion_tokens
    settled = account.settle(held, tokens, call_cost(tokens, price))
    assert settled.over_tokens == counted - prompt
    assert account.spent_tokens == tokens
    assert account.remaining_tokens() == max(0, budget - tokens)


def test_a_refused_carve_and_a_refused_retry_name_the_budget() -> None:
    with pytest.raises(BudgetRefused, match=r"^budget: children ask for 11 tokens"):
        carve(10, Decimal(1), SECONDS, [Ask("a", 11)])
    with pytest.raises(BudgetRefused, match=r"^budget: child 'a' asks for 301s"):
        carve(10, Decimal(1), SECONDS, [Ask("a", seconds=301)])
    with pytest.raises(BudgetRefused, match=r"^budget: retrying 1 children leaves them 5"):
        check_retry(4, Decimal(1), [ChildSpend(10, Decimal(0), 5, Decimal(0))])
