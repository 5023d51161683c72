"""FairSlots (runtime/llm/fair_slots.py): waiting model calls served in weighted fair order."""

from __future__ import annotations

import asyncio
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.llm.fair_slots import FairSlots


async def _serve(slots: FairSlots, calls: list[tuple[str, str, int, float, float]],
                 served: int) -> list[tuple[str, str]]:
    """Queue ``calls`` (tenant, tree, priority, weight, cost) behind one busy slot; return
    the order of the first ``served`` of them."""
    order: list[tuple[str, str]] = []
    gate = slots.ticket("blocker", "blocker")
    await gate.__aenter__()  # the only slot is busy: everything below waits
    done = asyncio.Event()

    async def call(tenant: str, tree: str, priority: int, weight: float, cost: float) -> None:
        ticket = slots.ticket(tenant, tree, priority, weight, cost)
        async with ticket:
            order.append((tenant, tree))
            ticket.settle(cost)
            if len(order) >= served:
                done.set()
            await asyncio.sleep(0)

    jobs = [asyncio.create_task(call(*c)) for c in calls]
    await asyncio.sleep(0)
    await gate.__aexit__(None, None, None)
    await done.wait()
    for job in jobs:
        job.cancel()
    await asyncio.gather(*jobs, return_exceptions=True)
    return order[:served]


def test_a_small_tree_is_not_served_after_a_wide_one() -> None:
    calls = [("t", "wide", 5, 1.0, 100.0)] * 50 + [("t", "small", 5, 1.0, 100.0)] * 3
    order = asyncio.run(_serve(FairSlots(1), calls, 8))
    assert order.count(("t", "small")) == 3, order


def test_priority_wins_within_a_tenant() -> None:
    calls = [("t", "a", 5, 1.0, 1.0)] * 5 + [("t", "b", 1, 1.0, 1.0)] * 2
    order = asyncio.run(_serve(FairSlots(1), calls, 2))
    assert order == [("t", "b")] * 2


@settings(max_examples=40, deadline=None)
@given(w1=st.integers(1, 5), w2=st.integers(1, 5), cost1=st.integers(1, 50),
       cost2=st.integers(1, 50))
def test_tenants_get_cost_shares_in_proportion_to_their_weights(
        w1: int, w2: int, cost1: int, cost2: int) -> None:
    backlog = 400
    calls = [("a", "ta", 5, float(w1), float(cost1))] * backlog + \
            [("b", "tb", 5, float(w2), float(cost2))] * backlog
    served = 120
    order = asyncio.run(_serve(FairSlots(1), calls, served))
    counts = Counter(t for t, _ in order)
    spent = {"a": counts["a"] * cost1, "b": counts["b"] * cost2}
    share = spent["a"] / (spent["a"] + spent["b"])
    want = w1 / (w1 + w2)
    # Served one call at a time, each tenant is at most one call's cost off its share.
    slack = max(cost1, cost2) / (spent["a"] + spent["b"]) * 2
    assert abs(share - want) <= slack + 1e-9, (counts, share, want)


def test_a_cancelled_waiter_gives_up_its_place_and_the_slot_is_not_lost() -> None:
    async def scenario() -> tuple[int, int]:
        slots = FairSlots(1)
        first = slots.ticket("t", "a")
        await first.__aenter__()
        waiter = asyncio.create_task(slots.ticket("t", "b").__aenter__())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await first.__aexit__(None, None, None)
        return slots.free, slots.waiting

    assert asyncio.run(scenario()) == (1, 0)


def test_an_overdue_call_is_served_first() -> None:
    async def scenario() -> list[str]:
        slots = FairSlots(1, max_wait_seconds=0.0)
        busy = slots.ticket("t", "x")
        await busy.__aenter__()
        order: list[str] = []

        async def call(tree: str, priority: int) -> None:
            async with slots.ticket("t", tree, priority):
                order.append(tree)

        old = asyncio.create_task(call("old", 9))
        await asyncio.sleep(0.01)
        urgent = asyncio.create_task(call("urgent", 0))
        await asyncio.sleep(0)
        await busy.__aexit__(None, None, None)
        await asyncio.gather(old, urgent)
        return order

    assert asyncio.run(scenario()) == ["old", "urgent"]


def test_the_worker_claims_no_more_than_one_round_of_model_slots_ahead() -> None:
    from types import SimpleNamespace

    from runtime.engine.worker.scheduler import Scheduler

    def room(slots: int, waiting: int, held: int, announced: bool = False) -> int:
        calls = SimpleNamespace(pressure=lambda loop: (slots, waiting))
        sched = Scheduler.__new__(Scheduler)
        sched.config = SimpleNamespace(  # type: ignore[assignment]
            worker=SimpleNamespace(max_in_flight=1000))
        sched.async_agents = True
        sched.held = [None] * held  # type: ignore[assignment]
        sched.executor = SimpleNamespace(llm_factory=SimpleNamespace(calls=calls))  # type: ignore[assignment]

        async def ask() -> int:
            return sched.room(announced)

        return asyncio.run(ask())

    assert room(0, 0, 10) == 990  # no model call made yet: max_in_flight alone
    assert room(8, 0, 10) == 16  # one more round of 8 slots, besides the calls running
    assert room(8, 12, 30) == 4
    assert room(8, 40, 60) == 0  # a deep queue at the slots: claim nothing more
    assert room(8, 40, 60, announced=True) == 4  # new work: a round more, 8 rounds in all
    assert room(8, 40, 30, announced=True) == 8


def test_slots_freed_together_are_shared_in_fair_order() -> None:
    """Four calls that started together end together: the four slots they free go in fair
    order, each charged as it is handed out (a newcomer is not left for the next wave)."""

    async def scenario() -> list[str]:
        slots = FairSlots(4)
        running = [slots.ticket("big", "B", estimate=10.0) for _ in range(4)]
        for ticket in running:
            await ticket.__aenter__()
        granted: list[str] = []

        async def call(tenant: str) -> None:
            async with slots.ticket(tenant, tenant, estimate=10.0):
                granted.append(tenant)
                await asyncio.Event().wait()  # holds its slot

        jobs = [asyncio.create_task(call("big")) for _ in range(20)]
        await asyncio.sleep(0)
        jobs.append(asyncio.create_task(call("small")))
        await asyncio.sleep(0)
        for ticket in running:  # one wave: all four end before any waiter resumes
            await ticket.__aexit__(None, None, None)
        await asyncio.sleep(0)
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        return granted

    granted = asyncio.run(scenario())
    assert len(granted) == 4 and "small" in granted, granted


# ------------------------------------------------------------------ anticipation
async def _anticipation(slots: FairSlots, answered: bool, next_after: float | None,
                        watch: float) -> list[str]:
    """One slot of ``slots`` runs a small tree's call while a wide tree's calls wait for
    it (``slots.limit`` - 1 others run). The small call ends (``answered`` or not); its
    tree's next call comes ``next_after`` s later (None: never). Returns who got a slot
    in the ``watch`` s after the small call ended, in order."""
    busy = [slots.ticket("wide", "W", estimate=10.0) for _ in range(slots.limit - 1)]
    for ticket in busy:
        await ticket.__aenter__()
    small = slots.ticket("small", "S", estimate=1.0)  # behind: it has spent less
    await small.__aenter__()
    got: list[str] = []

    async def call(tenant: str, tree: str, delay: float = 0.0) -> None:
        await asyncio.sleep(delay)
        async with slots.ticket(tenant, tree, estimate=1.0 if tree == "S" else 10.0):
            got.append(tree)
            await asyncio.Event().wait()  # holds its slot

    jobs = [asyncio.create_task(call("wide", "W")) for _ in range(5)]
    await asyncio.sleep(0)
    if answered:
        await small.answer(asyncio.sleep(0))
    await small.__aexit__(None, None, None)
    if next_after is not None:
        jobs.append(asyncio.create_task(call("small", "S", next_after)))
    await asyncio.sleep(watch)
    for job in jobs:
        job.cancel()
    await asyncio.gather(*jobs, return_exceptions=True)
    return got


def test_a_slot_is_kept_for_the_next_call_of_a_tree_that_is_behind() -> None:
    slots = FairSlots(2, anticipate_seconds=0.5)
    got = asyncio.run(_anticipation(slots, answered=True, next_after=0.02, watch=0.1))
    assert got == ["S"], got  # the wide tree's waiting calls did not take it meanwhile
    assert (slots.held, slots.held_taken) == (1, 1)


def test_a_kept_slot_goes_to_the_waiting_calls_when_no_next_call_comes() -> None:
    slots = FairSlots(2, anticipate_seconds=0.5)
    early = asyncio.run(_anticipation(slots, answered=True, next_after=None, watch=0.02))
    assert early == [] and slots.held == 1  # still kept 20 ms after
    slots = FairSlots(2, anticipate_seconds=0.05)
    late = asyncio.run(_anticipation(slots, answered=True, next_after=None, watch=0.2))
    assert late == ["W"] and (slots.held, slots.held_taken) == (1, 0)
    assert (slots.free, slots.waiting) == (1, 0)  # the wide call that ran is cancelled


def test_slots_are_not_lost_when_waiting_calls_are_cancelled_as_a_slot_frees() -> None:
    """A running call and the calls waiting behind it are cancelled together (a worker
    stopping): the running one's slot must not go to a waiter that will never use it."""
    for anticipate in (0.0, 0.05):
        slots = FairSlots(2, anticipate_seconds=anticipate)
        asyncio.run(_anticipation(slots, answered=False, next_after=None, watch=0.01))
        assert (slots.free, slots.waiting) == (1, 0), anticipate  # 1: the busy ticket


def test_a_call_that_was_not_answered_hands_its_slot_on_at_once() -> None:
    """A call the gate held back (its tree paused) or that failed keeps nothing: a paused
    tree's calls, coming back every poll, must not keep slots from the others."""
    slots = FairSlots(2, anticipate_seconds=0.5)
    got = asyncio.run(_anticipation(slots, answered=False, next_after=0.02, watch=0.1))
    assert got[0] == "W" and slots.held == 0, got


def test_no_slot_is_kept_while_a_call_is_overdue() -> None:
    """A call waiting longer than max_wait_seconds is served first: not kept from it."""
    slots = FairSlots(2, max_wait_seconds=0.0, anticipate_seconds=0.5)
    got = asyncio.run(_anticipation(slots, answered=True, next_after=0.02, watch=0.1))
    assert got[0] == "W" and slots.held == 0, got


def test_anticipation_set_to_zero_never_keeps_a_slot() -> None:
    slots = FairSlots(2, anticipate_seconds=0.0)
    got = asyncio.run(_anticipation(slots, answered=True, next_after=0.02, watch=0.1))
    assert got[0] == "W" and slots.held == 0, got


def test_flows_that_keep_calls_waiting_never_keep_a_slot() -> None:
    """Two tenants with backlogs: every slot freed goes straight to a waiting call."""

    async def scenario(slots: FairSlots) -> Counter[str]:
        served: Counter[str] = Counter()

        async def call(tenant: str) -> None:
            ticket = slots.ticket(tenant, tenant, estimate=10.0)
            async with ticket:
                await ticket.answer(asyncio.sleep(0.001))
                served[tenant] += 1

        jobs = [asyncio.create_task(call(t)) for t in ("a", "b") for _ in range(30)]
        await asyncio.gather(*jobs)
        return served

    slots = FairSlots(2, anticipate_seconds=0.5)
    served = asyncio.run(asyncio.wait_for(scenario(slots), 5))
    assert served == Counter({"a": 30, "b": 30})
    assert slots.held <= 2, slots.held  # at most the last calls, when the other has none left
