"""A tree's budget holds with a thousand leaves calling at once (real database, real charges).

A planner whose budget fits exactly 600 leaf calls delegates 1,000 leaves: 600 ask for one
call's worth each, the other 400 get the even share of what is left (nothing). All 1,000
leaves then run at the same moment in 1,000 threads through the real executor, the real
model handle (offline backend) and ``Store.charge``; each tries three calls. Whatever the
interleaving, no more than 600 calls' worth is spent, every refused call says ``budget:``,
and once the tree is done its spend equals the sum of its nodes and of its model calls
(the spend rolled up at fan-in, not per call).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import sqlalchemy as sa

from agents.base import Agent, ChildSpec, Delegate, Result, TaskView
from agents.context import AgentContext
from runtime.errors import BudgetExceeded
from runtime.llm.reply import estimate_tokens
from runtime.wiring import Runtime
from tests.factories import submit, terminal_event_counts
from tests.support_agents import AnyInput, AnyOutput

LEAVES = 1000
FUNDED = 600
CALLS_PER_LEAF = 3
MAX_TOKENS = 20
PROMPT = "budget leaf: say something short"
#: What one leaf call may spend at most: its prompt estimate plus its completion cap.
CALL_TOKENS = estimate_tokens(PROMPT) + MAX_TOKENS


class GreedyLeaf(Agent):
    """Tries :data:`CALLS_PER_LEAF` calls; reports what it spent and every refusal."""

    name = "budget_greedy_leaf"
    input_model = AnyInput
    output_model = AnyOutput

    def run(self, ctx: AgentContext, task: TaskView) -> Result:
        calls, refused = 0, []
        for _ in range(CALLS_PER_LEAF):
            try:
                ctx.llm.complete(PROMPT, max_tokens=MAX_TOKENS)
                calls += 1
            except BudgetExceeded as exc:
                refused.append(str(exc))
        return Result({"calls": calls, "refused": refused})


class BudgetPlanner(Agent):
    """Delegates :data:`LEAVES` leaves: :data:`FUNDED` funded for one call, the rest not."""

    name = "budget_planner"
    input_model = AnyInput
    output_model = AnyOutput
    delegates_to = ("budget_greedy_leaf",)

    def run(self, ctx: AgentContext, task: TaskView) -> Delegate:
        return Delegate([
            ChildSpec("budget_greedy_leaf", {"goal": f"leaf {i}"}, key=f"leaf-{i}",
                      budget_tokens=CALL_TOKENS if i < FUNDED else None)
            for i in range(LEAVES)])

    def aggregate(self, ctx: AgentContext, task: TaskView, children: list[Any]) -> Result:
        return Result({"calls": sum(c.result["calls"] for c in children if c.ok)})


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime]) -> Runtime:
    return make_runtime(ORGCHART_POLICIES__MAX_CHILDREN=str(LEAVES))


def test_a_thousand_concurrent_leaves_never_overspend_the_tree(runtime: Runtime) -> None:
    store = runtime.store
    root = submit(store, "budget_planner", {"goal": "spend"},
                  budget_tokens=FUNDED * CALL_TOKENS)
    worker = runtime.worker(["budget_planner", "budget_greedy_leaf", "judge"],
                            maintenance=False, listen=False, batch_size=1000)
    assert worker.run_once() == 1  # the planner delegates
    assert store.reads.get(root["id"])["status"] == "waiting", store.reads.get(root["id"])["error"]
    leaves = store.claims.claim(["budget_greedy_leaf"], LEAVES, "budget-test", 60)
    assert len(leaves) == LEAVES

    start = threading.Barrier(LEAVES)

    def run_leaf(row: Any) -> Any:
        start.wait()  # every leaf calls the model at the same moment
        return worker.executor.execute(row, threading.Event())

    with ThreadPoolExecutor(max_workers=LEAVES) as pool:
        actions = list(pool.map(run_leaf, leaves))
    worker.apply(actions)
    while worker.run_once():  # the planner aggregates
        pass

    done = store.reads.get(root["id"])
    assert done["status"] == "done", done["error"]
    children = store.reads.children(root["id"])
    unfinished = {c["status"]: c["error"] for c in children if c["status"] != "done"}
    assert not unfinished, unfinished  # a refused call is the leaf's answer, not its failure
    calls = sum(c["result"]["calls"] for c in children)
    refusals = [r for c in children for r in c["result"]["refused"]]
    with store.engine.connect() as conn:
        recorded, recorded_tokens = conn.execute(sa.text(
            "SELECT count(*), COALESCE(sum(prompt_tokens + completion_tokens), 0) "
            "FROM model_calls")).one()
    print(f"\n{LEAVES} leaves x {CALLS_PER_LEAF} tries: {calls} calls answered, "
          f"{len(refusals)} refused; tree spent {done['spent_tokens']} of "
          f"{done['budget_tokens']} tokens ({CALL_TOKENS} per call)")
    assert calls <= FUNDED
    assert recorded == calls
    assert done["spent_tokens"] <= FUNDED * CALL_TOKENS
    assert done["spent_tokens"] == recorded_tokens
    assert len(refusals) == LEAVES * CALLS_PER_LEAF - calls
    assert refusals and all(r.startswith("budget:") for r in refusals)
    # Totals rolled up at fan-in equal the nodes' own spend and the live sum by root.
    assert done["spent_tokens"] == done["own_tokens"] + sum(c["spent_tokens"] for c in children)
    assert store.spend.live(root["id"])[0] == recorded_tokens
    assert all(n == 1 for n in terminal_event_counts(store).values())
