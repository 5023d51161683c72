"""Durable steps against a real PostgreSQL: recorded once, replayed, re-run, fenced, retried."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from agents.context import AgentContext
from agents.tools import RetryPolicy, TransientStepError, idempotency_key
from runtime.engine.store_ledger import StoreLedger
from runtime.errors import BudgetExceeded, LeaseLost
from runtime.llm.durable_steps import TaskSteps
from runtime.store.rows import NewTask, StepBegin
from runtime.store.store import Store
from tests.factories import expire_leases


def claim(store: Store) -> Any:
    (row,) = store.claims.claim(["scout"], 1, "w", 30)
    return row


def new_task(store: Store) -> Any:
    store.tasks.submit(NewTask(to_agent="scout", type="task", payload={"goal": "g"}))
    return claim(store)


def redeliver(store: Store) -> Any:
    """The worker died: its lease expires, the reaper releases the task, it is claimed again."""
    expire_leases(store)
    assert store.hygiene.reap(max_delivery=10).released == 1
    return claim(store)


def steps_for(store: Store, row: Any, lost: threading.Event | None = None) -> TaskSteps:
    return TaskSteps(StoreLedger(store), row, row["lease_token"], lost or threading.Event())


class SideEffects:
    """A function with a visible side effect: one line per call, with its key."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def send(self, what: str, idempotency_key: str) -> dict[str, Any]:
        self.calls.append((idempotency_key, what))
        return {"sent": what, "n": len(self.calls)}


def test_a_recorded_step_returns_its_result_on_redelivery_without_running(store: Store) -> None:
    effects = SideEffects()
    row = new_task(store)
    first = steps_for(store, row).step("send", effects.send, "hello")
    again = steps_for(store, redeliver(store)).step("send", effects.send, "hello")
    assert first == again == {"sent": "hello", "n": 1}
    assert len(effects.calls) == 1
    (step,) = store.steps.for_task(row["id"])
    assert (step["status"], step["starts"], step["replays"], step["tries"]) == (
        "finished", 1, 1, 1)
    assert step["result"] == first and step["idempotency_key"] == effects.calls[0][0]
    assert step["args"] == '{"args":["hello"],"kwargs":{}}'


def test_a_step_started_but_never_recorded_runs_again_with_the_same_key(store: Store) -> None:
    row = new_task(store)
    steps = steps_for(store, row)
    # The worker records the start, then dies inside the function.
    begin = steps.begin_of("send", ("hello",), {}, steps.next_position())
    store.steps.begin(begin)
    effects = SideEffects()
    assert steps_for(store, redeliver(store)).step("send", effects.send, "hello")["n"] == 1
    (step,) = store.steps.for_task(row["id"])
    assert (step["status"], step["starts"], step["replays"]) == ("finished", 2, 0)
    assert effects.calls[0][0] == begin.idempotency_key == step["idempotency_key"]


def test_a_late_workers_step_result_is_not_recorded(store: Store) -> None:
    row = new_task(store)
    late = steps_for(store, row)
    expire_leases(store)
    store.hygiene.reap(max_delivery=10)
    fresh = claim(store)

    def slow(x: int) -> int:
        return x

    # The late worker's start is refused outright (its token no longer matches).
    with pytest.raises(LeaseLost, match="step 'double'"):
        late.step("double", slow, 2)
    assert store.steps.for_task(row["id"]) == []
    # Started under the lease, then the lease is taken away while it runs: no result.
    holder = steps_for(store, fresh)

    def taken_away(x: int) -> int:
        expire_leases(store)
        store.hygiene.reap(max_delivery=10)
        return x * 2

    with pytest.raises(LeaseLost, match="not recorded"):
        holder.step("double", taken_away, 2)
    (step,) = store.steps.for_task(row["id"])
    assert (step["status"], step["result"]) == ("started", None)
    third = claim(store)
    assert steps_for(store, third).step("double", slow, 2) == 2
    assert store.steps.for_task(row["id"])[0]["starts"] == 2


def test_transient_errors_are_retried_with_backoff_and_other_errors_recorded(
        store: Store) -> None:
    row = new_task(store)
    steps = steps_for(store, row)
    tries: list[int] = []

    def flaky() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise TransientStepError("busy")
        return "ok"

    assert steps.step("flaky", flaky, retry=RetryPolicy(attempts=3, backoff_seconds=0)) == "ok"

    def broken() -> None:
        raise ValueError("no such record")

    with pytest.raises(ValueError, match="no such record"):
        steps.step("broken", broken, retry=RetryPolicy(attempts=3, backoff_seconds=0))
    flaky_row, broken_row = store.steps.for_task(row["id"])
    assert (flaky_row["status"], flaky_row["tries"]) == ("finished", 3)
    assert (broken_row["status"], broken_row["tries"]) == ("failed", 1)
    assert broken_row["error"] == "ValueError: no such record"
    # A failed step is not served from the record: the next delivery tries again.
    again = steps_for(store, redeliver(store))
    again.step("flaky", flaky)
    assert again.step("broken", lambda: "fixed") == "fixed"
    assert [s["starts"] for s in store.steps.for_task(row["id"])] == [1, 2]


def test_changed_arguments_at_the_same_place_are_a_new_step(store: Store) -> None:
    row = new_task(store)
    effects = SideEffects()
    steps_for(store, row).step("send", effects.send, "a")
    steps_for(store, redeliver(store)).step("send", effects.send, "b")
    assert [what for _, what in effects.calls] == ["a", "b"]
    assert effects.calls[0][0] != effects.calls[1][0]


def test_async_steps_run_at_once_and_keep_their_positions(store: Store) -> None:
    row = new_task(store)
    seen: list[str] = []

    async def fetch(name: str) -> str:
        seen.append(idempotency_key())
        await asyncio.sleep(0.01)
        return name.upper()

    async def agent(steps: TaskSteps) -> list[str]:
        return list(await asyncio.gather(*(steps.astep("fetch", fetch, n)
                                           for n in ("a", "b", "c"))))

    assert asyncio.run(agent(steps_for(store, row))) == ["A", "B", "C"]
    assert asyncio.run(agent(steps_for(store, redeliver(store)))) == ["A", "B", "C"]
    assert len(seen) == 3
    rows = store.steps.for_task(row["id"])
    # Rows are inserted as the three begin at once; their positions follow the order of issue.
    assert sorted((r["position"], r["args"], r["replays"]) for r in rows) == [
        ("0", '{"args":["a"],"kwargs":{}}', 1), ("1", '{"args":["b"],"kwargs":{}}', 1),
        ("2", '{"args":["c"],"kwargs":{}}', 1)]


def test_ctx_step_uses_the_model_handles_steps_and_refuses_past_the_deadline(
        store: Store) -> None:
    row = new_task(store)
    steps = steps_for(store, row)
    ctx = AgentContext(llm=type("LLM", (), {"steps": steps})(), task=None,  # type: ignore
                       log=__import__("logging").getLogger("t"))
    assert ctx.step("add", lambda a, b: a + b, 1, 2) == 3
    spent = row.replace(deadline_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
    late = AgentContext(llm=type("LLM", (), {"steps": steps_for(store, spent)})(),  # type: ignore
                        task=None, log=__import__("logging").getLogger("t"))
    with pytest.raises(BudgetExceeded, match="budget_seconds"):  # its budget_seconds spent
        late.step("add", lambda a, b: a + b, 1, 2)


def test_a_step_with_a_result_that_is_not_json_fails_and_says_so(store: Store) -> None:
    row = new_task(store)
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        steps_for(store, row).step("thing", object)
    assert store.steps.for_task(row["id"])[0]["status"] == "failed"


def test_step_begin_without_the_lease_writes_nothing(store: Store) -> None:
    row = new_task(store)
    begin = StepBegin(row["id"], uuid.uuid4(), "run", "0", "x", "{}", "h", "k", 1)
    assert store.steps.begin(begin) is None
    assert store.steps.for_task(row["id"]) == []


def test_step_writes_survive_a_lost_connection_and_a_repeated_finish_charges_once(
        store: Store) -> None:
    from decimal import Decimal

    from runtime.store.rows import StepEnd

    row = new_task(store)
    ledger = StoreLedger(store)
    steps = steps_for(store, row)
    begin = steps.begin_of("send", ("a",), {}, "0")

    async def run() -> tuple[bool, bool]:
        record = await ledger.astep_begin(begin)
        assert record is not None
        # The server ends the writer's connection (a restart, a failover): the next
        # statement runs again on a new one.
        pids = ledger.step_writer.idle_backend_pids()
        assert len(pids) == 1
        with store.engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pids[0]})
        end = StepEnd(row["id"], row["lease_token"], record.step_id, record.starts,
                      {"ok": 1}, None, 1, 0.01, Decimal("0.5"))
        first = await ledger.astep_finish(end)
        again = await ledger.astep_finish(end)  # as after an in-doubt commit: no 2nd charge
        await ledger.aclose()
        return first, again

    first, again = asyncio.run(run())
    assert first and again
    (step,) = store.steps.for_task(row["id"])
    assert (step["status"], step["result"], step["starts"]) == ("finished", {"ok": 1}, 1)
    assert store.reads.get(row["id"])["own_usd"] == Decimal("0.5")
