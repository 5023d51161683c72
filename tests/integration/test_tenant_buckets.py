"""Token buckets per tenant (``[tenants.<name>] tokens_per_minute``), in the database.

The statement (``tenant_bucket_take``) from several threads at once, as several workers
take from one bucket; and :class:`runtime.llm.token_meter.TokenMeter` waiting on it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import sqlalchemy as sa

from runtime.errors import LeaseLost
from runtime.llm.fair_slots import FairSlots
from runtime.llm.gate import TaskStop
from runtime.llm.token_meter import TokenMeter
from runtime.store.rows import Tenancy
from runtime.store.store import Store
from tests.factories import submit


def _bucket(store: Store, tenant: str) -> tuple[float, Any] | None:
    with store.engine.connect() as conn:
        row = conn.execute(sa.text("SELECT tokens, refilled_at FROM tenant_buckets "
                                   "WHERE tenant = :t"), {"t": tenant}).first()
    return None if row is None else (float(row[0]), row[1])


async def _refilled_after(store: Store, tenant: str, when: Any) -> None:
    """Until a statement has refilled ``tenant``'s bucket after ``when`` (a refund's flush)."""
    deadline = time.monotonic() + 15.0
    while _bucket(store, tenant)[1] == when:  # type: ignore[index]
        assert time.monotonic() < deadline, "the refund was never sent"
        await asyncio.sleep(0.02)


def _age(store: Store, tenant: str, seconds: float) -> None:
    """Move the bucket's last refill ``seconds`` into the past (as if time went by)."""
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE tenant_buckets SET refilled_at = refilled_at "
                             "- make_interval(secs => :s) WHERE tenant = :t"),
                     {"s": seconds, "t": tenant})


def test_a_new_bucket_is_full_and_refuses_what_it_does_not_hold(store: Store) -> None:
    assert store.spend.take_tenant_tokens("acme", 400, 600) == 0.0
    assert _bucket(store, "acme")[0] == pytest.approx(200, abs=1)  # type: ignore[index]
    wait = store.spend.take_tenant_tokens("acme", 300, 600)  # 100 missing at 10 tokens/s
    assert 9.0 < wait <= 10.0
    assert _bucket(store, "acme")[0] == pytest.approx(200, abs=1)  # type: ignore[index]
    assert _bucket(store, "other") is None  # a tenant that never called has no row


def test_the_refill_is_capped_at_one_minutes_worth(store: Store) -> None:
    assert store.spend.take_tenant_tokens("acme", 600, 600) == 0.0
    _age(store, "acme", 3600)  # an hour idle, or a dead worker's reservation
    assert store.spend.take_tenant_tokens("acme", 600, 600) == 0.0
    assert store.spend.take_tenant_tokens("acme", 10, 600) > 0  # not 600 x 60 banked
    _age(store, "acme", 30)
    assert store.spend.take_tenant_tokens("acme", 290, 600) == 0.0  # half a minute: 300


def test_refunds_come_back_and_overspending_goes_negative(store: Store) -> None:
    assert store.spend.take_tenant_tokens("acme", 600, 600) == 0.0
    assert store.spend.take_tenant_tokens("acme", 100, 600, refund=150) == 0.0  # 150 back, 100 out
    assert _bucket(store, "acme")[0] == pytest.approx(50, abs=2)  # type: ignore[index]
    assert store.spend.take_tenant_tokens("acme", 0, 600, refund=-250) == 0.0  # spent 250 more
    assert _bucket(store, "acme")[0] == pytest.approx(-200, abs=2)  # type: ignore[index]
    assert store.spend.take_tenant_tokens("acme", 1, 600) > 20  # owes 200 first (20 s)


def test_concurrent_takers_never_take_more_than_the_bucket_gives(store: Store) -> None:
    """Eight threads (as many workers) take 20 at a time for 3 s from a 1,200/min bucket."""
    rate, need, threads, seconds = 1200.0, 20.0, 8, 3.0
    taken = [0.0] * threads
    start = time.monotonic()

    def taker(i: int) -> None:
        while time.monotonic() - start < seconds:
            if store.spend.take_tenant_tokens("acme", need, rate) == 0.0:
                taken[i] += need
            else:
                time.sleep(0.02)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(taker, range(threads)))
    elapsed = time.monotonic() - start
    allowed = rate + rate / 60 * elapsed
    assert sum(taken) <= allowed + need, (sum(taken), allowed)
    assert sum(taken) >= rate  # the burst was served


def _meter(store: Store, rates: dict[str, int]) -> TokenMeter:
    async def off_loop(fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    return TokenMeter(rates, store.spend.take_tenant_tokens, off_loop)


def test_a_tenant_without_a_limit_never_reaches_the_bucket(store: Store) -> None:
    slots = FairSlots(2, meter=_meter(store, {"acme": 600}))

    async def call() -> None:
        async with slots.ticket("free", "tree", estimate=10_000) as ticket:
            ticket.settle(9_000)

    asyncio.run(call())
    assert _bucket(store, "free") is None and _bucket(store, "acme") is None


def test_a_call_waits_for_the_refill_and_settles_what_it_did_not_spend(store: Store) -> None:
    meter = _meter(store, {"acme": 1200})  # 20 tokens a second
    slots = FairSlots(4, meter=meter)

    async def calls() -> list[float]:
        ends = []
        # 20 left and 20 given back after the first; the second finds about 40 of its 80
        for estimate, spent in ((1180, 1160), (80, 80)):
            async with slots.ticket("acme", "t", estimate=estimate) as ticket:
                taken_at = _bucket(store, "acme")[1]  # type: ignore[index]
                ticket.settle(spent)
            ends.append(time.monotonic())
            if spent < estimate:  # the refund goes back in a statement of its own
                await _refilled_after(store, "acme", taken_at)
        return ends

    started = time.monotonic()
    ends = asyncio.run(calls())
    assert 1.0 < ends[1] - started < 4.0, ends  # waited about 2 s for the rest
    tokens = _bucket(store, "acme")[0]  # type: ignore[index]
    assert -5 < tokens < 25, tokens


def test_a_stopped_task_ends_its_wait_and_gives_nothing_back(store: Store) -> None:
    meter = _meter(store, {"acme": 60})  # one token a second
    slots = FairSlots(4, meter=meter)
    stop = threading.Event()

    async def call() -> None:
        ticket = slots.ticket("acme", "t", estimate=60,
                              stopped=lambda: "stopped" if stop.is_set() else None)
        async with ticket:
            pass
        ticket.settle(60)
        second = slots.ticket("acme", "t", estimate=30,
                              stopped=lambda: "stopped" if stop.is_set() else None)
        asyncio.get_running_loop().call_later(0.5, stop.set)
        async with second:
            raise AssertionError("the bucket was empty: the call may not start")

    started = time.monotonic()
    with pytest.raises(LeaseLost):
        asyncio.run(call())
    assert time.monotonic() - started < 3.0  # not the 30 s the refill needs
    assert slots.free == 4 and slots.waiting == 0
    assert _bucket(store, "acme")[0] < 5  # type: ignore[index]


def test_the_meter_names_the_tasks_whose_calls_wait(store: Store) -> None:
    """A call that gets its tokens at once is not waiting; one left to the refill is."""
    meter = _meter(store, {"acme": 60})  # one token a second
    first = TaskStop("first", threading.Event(), lambda _: False)
    second = TaskStop("second", threading.Event(), lambda _: False)
    seen: list[set[Any]] = []

    async def calls() -> None:
        assert await meter.reserve("acme", 60, first) == 60  # the whole bucket, at once
        seen.append(meter.waiting_tasks())
        waiting = asyncio.ensure_future(meter.reserve("acme", 30, second))
        for _ in range(500):  # until its take came back short (a round trip off the loop)
            if meter.waiting_tasks() or waiting.done():
                break
            await asyncio.sleep(0.01)
        seen.append(meter.waiting_tasks())
        second.lease_lost.set()  # what a stopping worker does to a task it lets go
        with pytest.raises(LeaseLost):
            await waiting
        seen.append(meter.waiting_tasks())

    asyncio.run(calls())
    assert seen == [set(), {"second"}, set()]


def test_the_claim_leaves_a_tenants_tasks_while_its_bucket_is_dry(store: Store) -> None:
    store.policies.tenancy = Tenancy(rates={"acme": 600})  # 10 tokens a second
    metered = [submit(store, tenant="acme")["id"] for _ in range(2)]
    other = submit(store, tenant="beta")["id"]
    assert store.spend.take_tenant_tokens("acme", 600, 600) == 0.0  # emptied
    assert [t["id"] for t in store.claims.claim(["echo"], 10, "w", 30)] == [other]
    _age(store, "acme", 2.0)  # two seconds' refill: more than one second's worth
    assert {t["id"] for t in store.claims.claim(["echo"], 10, "w", 30)} == set(metered)
    assert store.claims.claim(["echo"], 10, "w", 30) == []


def test_a_tenant_without_a_limit_is_claimed_whatever_the_buckets_hold(store: Store) -> None:
    with store.engine.begin() as conn:  # a bucket left by an earlier configuration
        conn.execute(sa.text("INSERT INTO tenant_buckets (tenant, tokens) VALUES ('acme', -1e6)"))
    task = submit(store, tenant="acme")["id"]
    assert [t["id"] for t in store.claims.claim(["echo"], 10, "w", 30)] == [task]
