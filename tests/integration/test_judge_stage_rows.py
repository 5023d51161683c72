"""The judge stage on a real row read back from PostgreSQL (Decimal, timestamptz, jsonb)."""

from __future__ import annotations

from decimal import Decimal

from runtime.config import Settings
from runtime.engine.judge_stage import judge_task
from runtime.store.rows import NewTask
from runtime.store.store import Store

SETTINGS = Settings()
SCHEMA = {"type": "object", "required": ["prices"],
          "properties": {"prices": {"type": "array", "items": {"type": "number"}}}}


def test_judging_a_row_read_back_from_postgres(store: Store) -> None:
    success = {"schema": SCHEMA, "checks": [{"path": "prices.0", "op": ">=", "value": 1}]}
    kill = {"max_cost_usd": 0.25, "deadline": "2999-01-01T00:00:00Z"}
    task, _ = store.tasks.submit(NewTask(to_agent="competitor_scout", type="task",
                                         payload={"goal": "prices"}, success_criteria=success,
                                         kill_criteria=kill))
    stored = store.reads.get(task["id"])
    stored["result"] = {"prices": [1.5]}
    assert isinstance(stored["spent_usd"], Decimal)
    judgement = judge_task(stored, store.reads.children(task["id"]), None, SETTINGS)
    assert judgement.to_status == "done", judgement.verdict
    stored["spent_usd"] = Decimal("0.30")
    judgement = judge_task(stored, [], None, SETTINGS)
    assert judgement.to_status == "escalated"
    assert judgement.error == "kill criteria: max_cost_usd: spent $0.30 > limit $0.25"
