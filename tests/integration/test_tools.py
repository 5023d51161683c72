"""The tool loop against a real PostgreSQL and a scripted Ollama-compatible server.

The server (``tests/fake_ollama.py``) answers a request that lists tools with the tool
calls its ``tool_plan`` gives for that conversation, then with a normal answer; the real
``ollama`` client talks to it. Every tool call is a durable step (``task_steps``), every
round's model call a durable call (``model_calls``).
"""

from __future__ import annotations

import asyncio
import threading
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel, Field

from agents.tools import Tool
from runtime.config import Settings
from runtime.engine.store_ledger import StoreLedger
from runtime.errors import BudgetExceeded, LeaseLost
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.backends.ollama import OllamaBackend
from runtime.llm.handle import LLMFactory, TaskLLM
from runtime.llm.tool_loop import ToolApprovalDenied, ToolApprovalNeeded, ToolRoundLimit
from runtime.store.rows import NewTask
from runtime.store.store import Store
from tests.factories import expire_leases
from tests.fake_ollama import FakeOllama, calls_until, fake_ollama_server  # noqa: F401

PROMPT = "Look up two numbers and add them"


class Lookup(BaseModel):
    n: int = Field(ge=0, le=100)


class Answer(BaseModel):
    total: int


def claim(store: Store) -> Any:
    (row,) = store.claims.claim(["scout"], 1, "w", 30)
    return row


def new_task(store: Store, **budget: Any) -> Any:
    store.tasks.submit(NewTask(to_agent="scout", type="task", payload={"goal": "g"}, **budget))
    return claim(store)


def redeliver(store: Store) -> Any:
    expire_leases(store)
    store.hygiene.reap(max_delivery=10)
    return claim(store)


def llm_for(store: Store, row: Any, backend: Any) -> TaskLLM:
    factory = LLMFactory(Settings(), StoreLedger(store), backend=backend, announcement="test")
    return factory.for_task(row, row["lease_token"], threading.Event())


class Ledger:
    """A side-effect log: one line per tool call that ran, with its idempotency key."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, int]] = []
        self.on_call: Any = None

    def lookup(self, n: int, idempotency_key: str) -> dict[str, int]:
        if self.on_call is not None:
            self.on_call(n)
        self.lines.append((idempotency_key, n))
        return {"n": n, "value": n * 10}

    def tool(self, **kw: Any) -> Tool:
        return Tool("lookup", "Look up the value of number n.", Lookup, self.lookup, **kw)


def test_the_loop_runs_tool_calls_as_steps_and_returns_the_final_answer(
        store: Store, fake_ollama: FakeOllama) -> None:
    fake_ollama.tool_plan = calls_until(2, "lookup")
    effects = Ledger()
    row = new_task(store)
    llm = llm_for(store, row, OllamaBackend(fake_ollama.url, 5.0))
    reply = llm.complete(PROMPT, tools=[effects.tool()], schema=Answer)
    Answer.model_validate(reply.data)
    assert reply.tool_rounds == 2 and effects.lines == [
        (effects.lines[0][0], 0), (effects.lines[1][0], 1)]
    assert [(t.id, t.name, t.arguments, t.result) for t in reply.tool_results] == [
        ("0#0.0", "lookup", {"n": 0}, {"n": 0, "value": 0}),
        ("0#1.0", "lookup", {"n": 1}, {"n": 1, "value": 10})]
    calls = store.reads.model_calls(row["id"])
    assert [c["position"] for c in calls] == ["0#0", "0#1", "0#2"]
    assert calls[0]["tool_calls"] == [{"id": "", "name": "lookup", "arguments": {"n": 0}}]
    assert calls[2]["tool_calls"] is None
    assert reply.cost_usd == sum(c["cost_usd"] for c in calls)
    # What the model was sent: the tools, its own calls, and the results as tool messages.
    last = fake_ollama.requests[-1]
    assert last["tools"][0]["function"]["name"] == "lookup"
    assert [m["role"] for m in last["messages"]] == ["user", "assistant", "tool",
                                                     "assistant", "tool"]
    assert last["messages"][2] == {"role": "tool", "tool_name": "lookup",
                                   "content": '{"n": 0, "value": 0}'}
    steps = store.steps.for_task(row["id"])
    assert [(s["kind"], s["tool_call_id"], s["status"]) for s in steps] == [
        ("tool", "0#0.0", "finished"), ("tool", "0#1.0", "finished")]


def test_a_redelivery_mid_loop_replays_rounds_and_tools_and_pays_nothing_twice(
        store: Store, fake_ollama: FakeOllama) -> None:
    fake_ollama.tool_plan = calls_until(3, "lookup")
    effects = Ledger()
    row = new_task(store)

    def die_on_second(n: int) -> None:
        if n == 1:  # the worker loses the task inside the second tool call
            expire_leases(store)
            store.hygiene.reap(max_delivery=10)

    effects.on_call = die_on_second
    with pytest.raises(LeaseLost):
        llm_for(store, row, OllamaBackend(fake_ollama.url, 5.0)).complete(
            PROMPT, tools=[effects.tool()])
    effects.on_call = None
    second = claim(store)
    reply = llm_for(store, second, OllamaBackend(fake_ollama.url, 5.0)).complete(
        PROMPT, tools=[effects.tool()])
    assert reply.tool_rounds == 3
    assert [t.replayed for t in reply.tool_results] == [True, False, False]
    # The side effect of call 0 happened once; call 1 ran twice (it was in flight at the
    # "kill"), with the same idempotency key both times.
    assert [n for _, n in effects.lines] == [0, 1, 1, 2]
    assert effects.lines[1][0] == effects.lines[2][0]
    # Each distinct request reached the server once: rounds 0 and 1 were replayed.
    assert sorted(fake_ollama.seen.values()) == [1, 1, 1, 1]
    calls = store.reads.model_calls(row["id"])
    replayed = [c["position"] for c in calls if c["replayed"]]
    assert replayed == ["0#0", "0#1"]
    assert all(c["cost_usd"] == 0 for c in calls if c["replayed"])
    steps = {s["tool_call_id"]: s for s in store.steps.for_task(row["id"])}
    assert (steps["0#0.0"]["replays"], steps["0#1.0"]["starts"]) == (1, 2)


def test_bad_arguments_go_back_to_the_model_as_a_repair_and_never_reach_the_tool(
        store: Store, fake_ollama: FakeOllama) -> None:
    fake_ollama.tool_plan = calls_until(
        2, "lookup", arguments=lambda i: {"n": "many"} if i == 0 else {"n": 5})
    effects = Ledger()
    row = new_task(store)
    reply = llm_for(store, row, OllamaBackend(fake_ollama.url, 5.0)).complete(
        PROMPT, tools=[effects.tool()])
    assert [n for _, n in effects.lines] == [5]
    bad = reply.tool_results[0]
    assert bad.result is None and bad.error is not None
    assert bad.error.startswith("BadToolArguments: the arguments do not fit tool 'lookup'")
    sent = fake_ollama.requests[1]["messages"][2]
    assert sent["role"] == "tool" and sent["content"].startswith("error: BadToolArguments")
    kinds = [c["attempt_kind"] for c in store.reads.model_calls(row["id"])]
    assert kinds == ["call", "repair", "call"]
    assert store.steps.for_task(row["id"])[0]["status"] == "failed"


def test_the_round_limit_ends_a_runaway_loop_with_a_clear_error(
        store: Store, fake_ollama: FakeOllama) -> None:
    fake_ollama.tool_plan = calls_until(1000, "lookup", arguments=lambda i: {"n": i % 100})
    row = new_task(store)
    with pytest.raises(ToolRoundLimit, match=r"still called tools \(lookup\) after "
                                             r"max_tool_rounds=2"):
        llm_for(store, row, OllamaBackend(fake_ollama.url, 5.0)).complete(
            PROMPT, tools=[Ledger().tool()], max_tool_rounds=2)
    assert len(store.reads.model_calls(row["id"])) == 3
    assert len(store.steps.for_task(row["id"])) == 2


def test_a_tool_that_raises_answers_the_model_with_its_error(
        store: Store, fake_ollama: FakeOllama) -> None:
    fake_ollama.tool_plan = calls_until(1, "lookup")

    def broken(n: int) -> None:
        raise RuntimeError(f"no value for {n}")

    row = new_task(store)
    reply = llm_for(store, row, OllamaBackend(fake_ollama.url, 5.0)).complete(
        PROMPT, tools=[Tool("lookup", "Look up n.", Lookup, broken)])
    assert reply.tool_results[0].error == "RuntimeError: no value for 0"
    assert fake_ollama.requests[1]["messages"][2]["content"] == (
        "error: RuntimeError: no value for 0")
    (step,) = store.steps.for_task(row["id"])
    assert (step["status"], step["error"]) == ("failed", "RuntimeError: no value for 0")


def test_the_async_tool_calls_of_one_reply_run_at_once(
        store: Store, fake_ollama: FakeOllama) -> None:
    fake_ollama.tool_plan = calls_until(3, "lookup", per_round=3)
    started: list[int] = []
    all_in = asyncio.Event()

    async def slow_lookup(n: int) -> int:
        # Each call waits until all three have started: run one after another, the
        # first would wait in vain and fail with TimeoutError.
        started.append(n)
        if len(started) == 3:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), 20)
        return n

    row = new_task(store)
    llm = llm_for(store, row, OllamaBackend(fake_ollama.url, 5.0))

    async def run() -> Any:
        return await llm.acomplete(PROMPT, tools=[
            Tool("lookup", "Look up n.", Lookup, slow_lookup)])

    reply = asyncio.run(run())
    assert [t.error for t in reply.tool_results] == [None, None, None]
    assert reply.tool_rounds == 1 and [t.result for t in reply.tool_results] == [0, 1, 2]
    assert sorted(s["tool_call_id"] for s in store.steps.for_task(row["id"])) == [
        "0#0.0", "0#0.1", "0#0.2"]


def test_a_tools_cost_is_charged_and_checked_against_the_budget(store: Store) -> None:
    row = new_task(store, budget_usd=Decimal("0.5"))
    llm = llm_for(store, row, OfflineBackend())
    effects = Ledger()
    reply = llm.complete(PROMPT, tools=[effects.tool(cost_usd=Decimal("0.25"))],
                         schema=Answer)
    assert reply.offline and reply.tool_rounds == 1 and len(effects.lines) == 1
    task = store.reads.get(row["id"])
    calls = store.reads.model_calls(row["id"])
    assert task["own_usd"] == sum(c["cost_usd"] for c in calls) + Decimal("0.25")
    assert store.steps.for_task(row["id"])[0]["cost_usd"] == Decimal("0.25")
    with pytest.raises(BudgetExceeded, match=r"tool 'lookup' refused .* costs \$1"):
        llm.complete("Again", tools=[effects.tool(cost_usd=Decimal("1"))])
    assert len(effects.lines) == 1


def test_a_tool_that_requires_approval_is_never_run_without_it(store: Store) -> None:
    row = new_task(store)
    effects = Ledger()
    with pytest.raises(ToolApprovalNeeded, match=r"tool call 0#0.0 \(lookup\) waits"):
        llm_for(store, row, OfflineBackend()).complete(
            PROMPT, tools=[effects.tool(requires_approval=True)])
    assert effects.lines == []


def test_a_denied_tool_call_ends_the_loop_and_another_call_asks_anew(store: Store) -> None:
    row = new_task(store)
    effects = Ledger()
    llm = llm_for(store, row, OfflineBackend())
    tools = [effects.tool(requires_approval=True)]
    with pytest.raises(ToolApprovalNeeded):
        llm.complete(PROMPT, tools=tools)
    (ask,) = store.steps.tool_approvals(row["id"])
    with store.engine.begin() as conn:  # a person's decision (orgchart reject's update)
        conn.execute(sa.text("UPDATE tool_approvals SET status = 'denied' "
                             "WHERE task_id = :id"), {"id": row["id"]})
    again = llm_for(store, row, OfflineBackend())
    with pytest.raises(ToolApprovalDenied, match=r"tool call 0#0.0 \(lookup\) was denied"):
        again.complete(PROMPT, tools=tools)
    assert effects.lines == []
    # The decision holds for that call only: another call id asks again.
    with pytest.raises(ToolApprovalNeeded, match=r"tool call 1#0\.0"):
        again.complete(PROMPT, tools=tools)
    assert [(a["call_id"], a["status"]) for a in store.steps.tool_approvals(row["id"])] == [
        ("0#0.0", "denied"), ("1#0.0", "asked")]
    assert ask["args_hash"]


def test_a_tool_the_policy_refuses_is_never_run(store: Store) -> None:
    row = new_task(store)
    llm = llm_for(store, row, OfflineBackend())
    llm.tool_check = lambda name: f"policy allowed_tools: scout may not use {name!r}"
    effects = Ledger()
    reply = llm.complete(PROMPT, tools=[effects.tool()])
    assert effects.lines == []
    assert "policy allowed_tools: scout may not use 'lookup'" in str(reply.tool_results[0].error)


def test_a_worker_runs_a_scouts_tool_loop_and_traces_each_tool_call(
        db_url: str, store: Store) -> None:
    from runtime.config import load_settings
    from runtime.telemetry import traces
    from runtime.views import task_detail_json
    from runtime.wiring import build_runtime

    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "offline"})
    runtime = build_runtime(settings, store=store)
    task, _ = store.tasks.submit(NewTask(to_agent="trend_analyst", type="research",
                                         payload={"goal": "durable agent runtimes"}))
    worker = runtime.worker(None, maintenance=False, listen=False)
    for _ in range(20):
        if worker.run_once() == 0 and store.reads.get(task["id"])["status"] == "done":
            break
    done = store.reads.get(task["id"])
    assert done["status"] == "done", done["error"]
    assert done["result"]["tool_notes"] and done["result"]["offline"] is True
    (step,) = task_detail_json(store, task["id"])["steps"]
    assert (step["kind"], step["name"], step["tool_call_id"]) == (
        "tool", "search_trend_notes", "0#0.0")
    assert step["replayed"] is False and '"query"' in step["args"]
    spans = traces.build_spans(store.reads.trace_rows([task["id"]]))
    (tool,) = [s for s in spans if s.name.startswith("execute_tool")]
    (agent,) = [s for s in spans if s.name == "trend_analyst"]
    assert tool.name == "execute_tool search_trend_notes"
    assert tool.attributes["gen_ai.tool.name"] == "search_trend_notes"
    assert tool.attributes["gen_ai.tool.call.id"] == "0#0.0"
    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
    assert tool.parent.span_id == agent.context.span_id
    assert tool.start_time <= tool.end_time
    # The page's waterfall draws it as a segment of the task's bar.
    (row,) = store.reads.timeline_rows(task["id"])
    (segment,) = __import__("json").loads(row["json"])["tools"]
    assert segment[2:] == ["search_trend_notes", "finished"] and segment[0] <= segment[1]


def test_a_late_workers_tool_result_is_not_recorded_and_the_loop_stops(
        store: Store, fake_ollama: FakeOllama) -> None:
    # A tool round's record is written while the next model call runs: when the lease
    # was taken away meanwhile, the record is refused (so is the next call, by the start
    # gate) and the loop ends with LeaseLost.
    fake_ollama.tool_plan = calls_until(2, "lookup")
    effects = Ledger()
    effects.on_call = lambda n: (expire_leases(store), store.hygiene.reap(max_delivery=10))
    row = new_task(store)
    llm = llm_for(store, row, OllamaBackend(fake_ollama.url, 5.0))
    with pytest.raises(LeaseLost, match="pending; the model was not called"):
        llm.complete(PROMPT, tools=[effects.tool()])
    assert len(effects.lines) == 1  # the next round's tool never ran
    (step,) = store.steps.for_task(row["id"])
    assert (step["status"], step["result"]) == ("started", None)
    # The next delivery runs it again (same key), records it, and goes on.
    effects.on_call = None
    fresh = claim(store)
    reply = llm_for(store, fresh, OllamaBackend(fake_ollama.url, 5.0)).complete(
        PROMPT, tools=[effects.tool()])
    assert reply.tool_rounds == 2 and effects.lines[1][0] == effects.lines[0][0]
    assert [(s["status"], s["starts"]) for s in store.steps.for_task(row["id"])] == [
        ("finished", 2), ("finished", 1)]
