"""Models as they really behave: repair, in-call retries, limits, thinking, durable calls.

TaskLLM against a real PostgreSQL and the loopback Ollama-compatible server told to
misbehave (tests/fake_ollama.py), one mode at a time; then re-delivered tasks that are
served their recorded replies.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from decimal import Decimal
from typing import Any

import pytest
from pydantic import BaseModel, Field

from runtime.config import Settings
from runtime.engine.store_ledger import StoreLedger
from runtime.errors import TransientModelError
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.backends.ollama import OllamaBackend
from runtime.llm.fair_slots import FairSlots
from runtime.llm.handle import LLMFactory, TaskLLM
from runtime.llm.reply import BadModelReply
from runtime.store.rows import NewTask
from runtime.store.store import Store
from runtime.views import task_detail_json
from tests.factories import expire_leases
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

PROMPT = "Name two competitors of Acme Robotics"
FAST = {"retry_base_seconds": 0.01, "retry_max_seconds": 0.05}


class Findings(BaseModel):
    competitors: list[str] = Field(min_length=2, max_length=4)
    confidence: float = Field(ge=0, le=1)


def make_settings(**sections: Any) -> Settings:
    sections.setdefault("llm", {})
    sections["llm"] = {**FAST, **sections["llm"]}
    return Settings.model_validate(sections)


def claim_new(store: Store, **budget: Any) -> dict[str, Any]:
    store.tasks.submit(NewTask(to_agent="scout", type="task", payload={"goal": "g"}, **budget))
    (row,) = store.claims.claim(["scout"], 1, "w", 30)
    return row


def redeliver(store: Store, row: dict[str, Any]) -> dict[str, Any]:
    """What a dead worker leaves behind: the lease expires, the reaper frees it, a claim."""
    expire_leases(store, where=f"id = '{row['id']}'")
    store.hygiene.reap(max_delivery=10)
    (again,) = store.claims.claim(["scout"], 1, "w2", 30)
    assert again["id"] == row["id"] and again["lease_token"] != row["lease_token"]
    return again


@pytest.fixture
def factories() -> Any:
    made: list[LLMFactory] = []

    def make(store: Store, settings: Settings, backend: Any) -> LLMFactory:
        factory = LLMFactory(settings, StoreLedger(store), backend=backend,
                             announcement="test")
        made.append(factory)
        return factory

    yield make
    for factory in made:
        factory.close()


def llm_for(factories: Any, store: Store, row: dict[str, Any], settings: Settings,
            backend: Any) -> TaskLLM:
    return factories(store, settings, backend).for_task(row, row["lease_token"],
                                                        threading.Event())


def spent(store: Store, task_id: uuid.UUID) -> int:
    return int(store.reads.get(task_id)["spent_tokens"])


def charged(calls: list[dict[str, Any]]) -> int:
    return sum(int(c["prompt_tokens"]) + int(c["completion_tokens"]) for c in calls)


# ---------------------------------------------------------------------- repair
@pytest.mark.parametrize("mode", ["broken_json", "wrong_shape", "empty", "length"])
def test_a_bad_structured_reply_is_repaired_in_the_same_call(
        store: Store, fake_ollama: FakeOllama, factories: Any, mode: str) -> None:
    fake_ollama.script = [mode]
    row = claim_new(store)
    llm = llm_for(factories, store, row, make_settings(), OllamaBackend(fake_ollama.url, 5.0))
    reply = llm.complete(PROMPT, schema=Findings)
    Findings.model_validate(reply.data)
    assert reply.attempts == 2
    calls = store.reads.model_calls(row["id"])
    assert [c["attempt_kind"] for c in calls] == ["call", "repair"]
    assert calls[0]["error"].startswith("BadModelReply") and calls[1]["error"] is None
    # Both requests are charged (the bad reply's tokens were spent too).
    assert spent(store, row["id"]) == charged(calls)
    assert reply.cost_usd == sum(Decimal(c["cost_usd"]) for c in calls)
    # The repair carried the bad reply and its error back to the model.
    repair = fake_ollama.requests[-1]["messages"]
    assert [m["role"] for m in repair] == ["user", "assistant", "user"]
    assert "Your reply failed" in repair[2]["content"]


def test_when_every_repair_fails_the_error_names_model_error_and_attempts(
        store: Store, fake_ollama: FakeOllama, factories: Any) -> None:
    fake_ollama.script = ["broken_json", "wrong_shape", "empty"]
    row = claim_new(store)
    llm = llm_for(factories, store, row, make_settings(), OllamaBackend(fake_ollama.url, 5.0))
    with pytest.raises(BadModelReply, match=r"llama3.2:latest.*3 attempt.*nothing") as err:
        llm.complete(PROMPT, schema=Findings)
    assert "replied with nothing" in str(err.value)
    calls = store.reads.model_calls(row["id"])
    assert [c["attempt_kind"] for c in calls] == ["call", "repair", "repair"]
    assert all(c["error"] for c in calls) and spent(store, row["id"]) == charged(calls)


def test_the_offline_backend_can_be_told_to_misbehave(store: Store, factories: Any) -> None:
    row = claim_new(store)
    backend = OfflineBackend(script=["length", "transient", "wrong_shape"])
    llm = llm_for(factories, store, row, make_settings(), backend)
    reply = llm.complete(PROMPT, schema=Findings)
    Findings.model_validate(reply.data)
    kinds = [(c["attempt_kind"], (c["error"] or "").split(":")[0])
             for c in store.reads.model_calls(row["id"])]
    # The repair met a transient error, its retry a bad reply, the second repair worked.
    assert kinds == [("call", "BadModelReply"), ("repair", "TransientModelError"),
                     ("retry", "BadModelReply"), ("repair", "")]
    assert backend.calls == 4


# ---------------------------------------------------------------------- retries
@pytest.mark.parametrize("mode", ["429", "500", "502", "503", "hang"])
def test_a_transient_failure_is_retried_inside_the_call(
        store: Store, fake_ollama: FakeOllama, factories: Any, mode: str) -> None:
    fake_ollama.script = [mode]
    fake_ollama.retry_after = 0.3
    fake_ollama.hang_seconds = 2.0
    row = claim_new(store)
    timeout = 0.5 if mode == "hang" else 5.0
    llm = llm_for(factories, store, row, make_settings(), OllamaBackend(fake_ollama.url, timeout))
    started = time.monotonic()
    reply = llm.complete(PROMPT)
    waited = time.monotonic() - started
    assert reply.text.startswith("fake: ") and reply.attempts == 2
    calls = store.reads.model_calls(row["id"])
    assert [c["attempt_kind"] for c in calls] == ["call", "retry"]
    assert calls[0]["error"].startswith("TransientModelError")
    assert (calls[0]["prompt_tokens"], calls[0]["completion_tokens"]) == (0, 0)
    assert spent(store, row["id"]) == charged(calls[1:])
    if mode in ("429", "503"):  # Retry-After is honoured: never earlier than it says
        assert waited >= 0.3


def test_retries_are_spent_then_the_call_raises_transient(
        store: Store, fake_ollama: FakeOllama, factories: Any) -> None:
    fake_ollama.script = ["500"] * 5
    row = claim_new(store)
    llm = llm_for(factories, store, row, make_settings(llm={"call_retries": 2}),
                  OllamaBackend(fake_ollama.url, 5.0))
    with pytest.raises(TransientModelError, match="gave up after 3 request"):
        llm.complete(PROMPT)
    assert [c["attempt_kind"] for c in store.reads.model_calls(row["id"])] == ["call", "retry",
                                                                               "retry"]
    assert fake_ollama.received == 3


def test_a_busy_server_is_waited_for_without_spending_retries(
        store: Store, fake_ollama: FakeOllama, factories: Any) -> None:
    fake_ollama.script = ["503"] * 4
    fake_ollama.retry_after = 0.05
    row = claim_new(store)
    llm = llm_for(factories, store, row, make_settings(llm={"call_retries": 0}),
                  OllamaBackend(fake_ollama.url, 5.0))
    assert llm.complete(PROMPT).attempts == 5
    assert fake_ollama.modes["503"] == 4


def test_calls_in_flight_are_bounded_per_server_and_model(
        store: Store, fake_ollama: FakeOllama, factories: Any) -> None:
    fake_ollama.delay_seconds = 0.2
    row = claim_new(store)
    settings = make_settings(ollama={"max_parallel": 2})
    factory = factories(store, settings, OllamaBackend(fake_ollama.url, 5.0))
    llm = factory.for_task(row, row["lease_token"], threading.Event())

    async def six() -> list[Any]:
        return await asyncio.gather(*(llm.acomplete(f"{PROMPT} {i}") for i in range(6)))

    replies = factory.calls.run(six())
    assert len(replies) == 6 and fake_ollama.max_in_flight == 2
    assert sorted(r.call_index for r in replies) == list(range(6))


# ---------------------------------------------------------------------- thinking
def test_thinking_is_kept_apart_stored_and_counted(
        store: Store, fake_ollama: FakeOllama, factories: Any) -> None:
    row = claim_new(store)
    llm = llm_for(factories, store, row, make_settings(ollama={"think": True}),
                  OllamaBackend(fake_ollama.url, 5.0))
    reply = llm.complete(PROMPT, schema=Findings)
    Findings.model_validate(reply.data)
    assert reply.thinking and reply.thinking.startswith("fake thinking")
    assert "thinking" not in reply.text
    (call,) = store.reads.model_calls(row["id"])
    assert call["thinking"] == reply.thinking
    assert call["completion_tokens"] == fake_ollama.completion_tokens
    assert fake_ollama.requests[0]["think"] is True
    plain = claim_new(store)
    llm_for(factories, store, plain, make_settings(),
            OllamaBackend(fake_ollama.url, 5.0)).complete(PROMPT)
    assert fake_ollama.requests[-1]["think"] is False
    assert store.reads.model_calls(plain["id"])[0]["thinking"] is None


# ---------------------------------------------------------------------- durable calls
def test_a_redelivered_task_is_served_its_recorded_calls_at_zero_cost(
        store: Store, fake_ollama: FakeOllama, factories: Any) -> None:
    settings = make_settings()
    row = claim_new(store)
    first = llm_for(factories, store, row, settings, OllamaBackend(fake_ollama.url, 5.0))
    made = [first.complete(PROMPT, schema=Findings), first.complete("Summarise them"),
            first.complete("Rank them", key="rank")]
    paid = spent(store, row["id"])
    assert fake_ollama.received == 3
    # The worker dies; the task is delivered again and the agent runs from the start.
    again = redeliver(store, row)
    second = llm_for(factories, store, again, settings, OllamaBackend(fake_ollama.url, 5.0))
    served = [second.complete(PROMPT, schema=Findings),
              second.complete("Summarise them, differently"),  # changed its mind: new call
              second.complete("Rank them", key="rank"),
              second.complete("And one more thing")]  # a new call after the old ones
    assert [s.replayed for s in served] == [True, False, True, False]
    assert served[0].data == made[0].data and served[2].text == made[2].text
    assert served[0].cost_usd == 0 and served[0].prompt_tokens == 0
    assert fake_ollama.received == 5
    calls = store.reads.model_calls(row["id"])
    replayed = [c for c in calls if c["replayed"]]
    assert [(c["attempt"], c["position"], c["cost_usd"]) for c in replayed] == [
        (2, "0", Decimal(0)), (2, "key:rank", Decimal(0))]
    assert spent(store, row["id"]) == paid + charged([c for c in calls if c["attempt"] == 2])
    assert store.reads.metrics()["model_replays"] == 2
    # The task's history (orgchart show, GET /tasks/ID) says which were served from the record.
    shown = task_detail_json(store, row["id"])["model_calls"]
    assert [(c["attempt"], c["position"], c["replayed"]) for c in shown] == [
        (1, "0", False), (1, "1", False), (1, "key:rank", False),
        (2, "0", True), (2, "1", False), (2, "key:rank", True), (2, "3", False)]
    assert all(c["cost_usd"] == "0.00000000" for c in shown if c["replayed"])


def test_parallel_calls_keep_their_positions_across_deliveries(
        store: Store, fake_ollama: FakeOllama, factories: Any) -> None:
    settings = make_settings()
    prompts = [f"Part {i} of the survey" for i in range(4)]
    row = claim_new(store)

    async def run(llm: TaskLLM) -> list[Any]:
        return await asyncio.gather(*(llm.acomplete(p) for p in prompts))

    factory = factories(store, settings, OllamaBackend(fake_ollama.url, 5.0))
    made = factory.calls.run(run(factory.for_task(row, row["lease_token"],
                                                  threading.Event())))
    again = redeliver(store, row)
    factory = factories(store, settings, OllamaBackend(fake_ollama.url, 5.0))
    served = factory.calls.run(run(factory.for_task(again, again["lease_token"],
                                                    threading.Event())))
    assert all(s.replayed for s in served) and fake_ollama.received == 4
    assert [s.text for s in served] == [m.text for m in made]
    assert [s.position for s in served] == ["0", "1", "2", "3"]


def test_a_repaired_call_replays_its_good_reply(
        store: Store, fake_ollama: FakeOllama, factories: Any) -> None:
    fake_ollama.script = ["broken_json"]
    settings = make_settings()
    row = claim_new(store)
    first = llm_for(factories, store, row, settings, OllamaBackend(fake_ollama.url, 5.0))
    good = first.complete(PROMPT, schema=Findings)
    again = redeliver(store, row)
    second = llm_for(factories, store, again, settings, OllamaBackend(fake_ollama.url, 5.0))
    served = second.complete(PROMPT, schema=Findings)
    assert served.replayed and served.data == good.data and fake_ollama.received == 2
    metrics = store.reads.metrics()
    assert (metrics["model_repairs"], metrics["model_replays"]) == (1, 1)


def test_a_claim_says_whether_replies_are_on_record(store: Store, fake_ollama: FakeOllama,
                                                     factories: Any) -> None:
    settings = make_settings()
    row = claim_new(store)
    assert row.recorded_calls is False  # a first delivery: no call looks its record up
    llm_for(factories, store, row, settings, OllamaBackend(fake_ollama.url, 5.0)).complete(PROMPT)
    again = redeliver(store, row)
    assert again.recorded_calls is True
    reply = llm_for(factories, store, again, settings,
                    OllamaBackend(fake_ollama.url, 5.0)).complete(PROMPT)
    assert reply.replayed and fake_ollama.received == 1


def test_durable_calls_can_be_turned_off(store: Store, fake_ollama: FakeOllama,
                                         factories: Any) -> None:
    settings = make_settings(llm={"durable": False})
    row = claim_new(store)
    llm_for(factories, store, row, settings, OllamaBackend(fake_ollama.url, 5.0)).complete(PROMPT)
    again = redeliver(store, row)
    reply = llm_for(factories, store, again, settings,
                    OllamaBackend(fake_ollama.url, 5.0)).complete(PROMPT)
    assert not reply.replayed and fake_ollama.received == 2


# ---------------------------------------------------------------------- the loop
def test_sync_calls_run_on_the_attached_loop_and_async_calls_on_their_own(
        store: Store, fake_ollama: FakeOllama) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    factory = LLMFactory(make_settings(), StoreLedger(store),
                         backend=OllamaBackend(fake_ollama.url, 5.0), announcement="t")
    factory.attach(loop)  # as a worker does when its loop starts
    try:
        row = claim_new(store)
        llm = factory.for_task(row, row["lease_token"], threading.Event())
        # A synchronous agent in a worker thread: complete() waits on the attached loop.
        assert llm.complete(PROMPT).text.startswith("fake: ")
        assert factory.calls.loop is loop

        async def on_the_loop() -> Any:
            assert asyncio.get_running_loop() is loop
            with pytest.raises(RuntimeError, match="await acomplete"):
                llm.complete(PROMPT)
            return await llm.acomplete("Summarise them")

        reply = asyncio.run_coroutine_threadsafe(on_the_loop(), loop).result(10)
        assert reply.call_index == 1 and not reply.replayed
        # An async caller on another loop calls on that loop, with its own connections.
        assert asyncio.run(llm.acomplete("And again")).call_index == 2
        asyncio.run_coroutine_threadsafe(factory.detach(), loop).result(10)
        # Detached: sync calls go to the model layer's own loop thread.
        assert llm.complete("Once more").call_index == 3
        assert factory.calls.loop is not loop
    finally:
        factory.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    assert not thread.is_alive()
    assert fake_ollama.received == 4


def test_a_recorded_call_is_found_when_the_route_changed(
        store: Store, fake_ollama: FakeOllama, factories: Any) -> None:
    row = claim_new(store)
    local = make_settings(routing={"pending_threshold": 100})
    made = llm_for(factories, store, row, local,
                   OllamaBackend(fake_ollama.url, 5.0)).complete(PROMPT)
    assert made.route == "local"
    again = redeliver(store, row)
    store.tasks.submit(NewTask(to_agent="other", type="task", payload={}))  # a queue now
    cloud = make_settings(routing={"pending_threshold": 0})
    served = llm_for(factories, store, again, cloud,
                     OllamaBackend(fake_ollama.url, 5.0)).complete(PROMPT)
    assert served.replayed and served.text == made.text and served.route == "local"
    assert fake_ollama.received == 1




def _chain_gap(store: Store, fake_ollama: FakeOllama, factories: Any,
               anticipate: float) -> tuple[int, int]:
    """A wide tree's 6 calls and a small tree's chain of two on 2 slots: how many of the
    wide calls reached the server before the chain's second, and the slots kept for the
    small tree and taken."""
    settings = make_settings(ollama={"max_parallel": 2},
                             scheduler={"anticipate_seconds": anticipate})
    backend = OllamaBackend(fake_ollama.url, 5.0)
    factory = factories(store, settings, backend)
    llms = []
    for tenant in ("big", "small"):
        store.tasks.submit(NewTask(to_agent="scout", type="task", payload={"goal": tenant},
                                   tenant=tenant))
        (row,) = store.claims.claim(["scout"], 1, "w", 60)
        llms.append(factory.for_task(row, row["lease_token"], threading.Event()))
    wide, small = llms

    async def scenario() -> FairSlots:
        # The slots every call to the server shares (2: the tighter of the two limits).
        slots = factory.calls.slot(backend.host_for("local"), 2)
        calls = [asyncio.create_task(wide.acomplete(f"wide {i}")) for i in range(6)]
        deadline = time.monotonic() + 30
        while slots.waiting < 4:
            assert time.monotonic() < deadline, "the wide calls never queued"
            await asyncio.sleep(0.01)
        await small.acomplete("small first")  # waits for the wide wave, then goes first
        await small.acomplete("small second")  # made as soon as the first returned
        await asyncio.gather(*calls)
        return slots

    seen = len(fake_ollama.arrived)
    slots = factory.calls.run(scenario())
    order = [r["messages"][-1]["content"] for r in fake_ollama.arrived[seen:]]
    wide_before = sum(p.startswith("wide") for p in order[:order.index("small second")])
    return wide_before, slots.held_taken


def test_a_chain_of_calls_keeps_its_slot_beside_a_wide_tree(
        store: Store, fake_ollama: FakeOllama, factories: Any) -> None:
    """Anticipation through the model layer (runtime/llm/fair_slots.py): the small tree's
    second call takes the slot its first one freed, instead of waiting for one of the
    wide tree's calls (0.6 s; the small tree's take 0.2 s) to end."""
    fake_ollama.delay_for = lambda body: (
        0.2 if "small" in body["messages"][-1]["content"] else 0.6)
    kept, taken = _chain_gap(store, fake_ollama, factories, anticipate=1.0)
    handed_on, none_taken = _chain_gap(store, fake_ollama, factories, anticipate=0.0)
    assert taken >= 1 and none_taken == 0
    # Kept: the second starts as the first ends (0.8 s), after the wide calls begun at 0 s
    # and 0.6 s. Handed on: the first one's slot goes to a fourth wide call at 0.8 s, and
    # the second waits for the wide call begun at 0.6 s to end (1.2 s).
    assert (kept, handed_on) == (3, 4)
