"""Typed replies against a real PostgreSQL: ``reply.output`` is the schema's instance,
whether the call was made or replayed from the record of an earlier delivery."""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel, Field

from agents import Completion
from runtime.config import Settings
from runtime.engine.store_ledger import StoreLedger
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.handle import LLMFactory, TaskLLM
from runtime.store.rows import NewTask
from runtime.store.store import Store
from tests.factories import expire_leases

PROMPT = "Name two competitors of Acme Robotics"


class Findings(BaseModel):
    competitors: list[str] = Field(min_length=2, max_length=4)
    confidence: float = Field(ge=0, le=1)


def claim(store: Store) -> Any:
    (row,) = store.claims.claim(["scout"], 1, "w", 30)
    return row


def llm_for(store: Store, row: Any) -> TaskLLM:
    factory = LLMFactory(Settings(), StoreLedger(store), backend=OfflineBackend(),
                         announcement="test")
    return factory.for_task(row, row["lease_token"], threading.Event())


def test_the_output_is_the_schemas_instance_made_and_replayed(store: Store) -> None:
    store.tasks.submit(NewTask(to_agent="scout", type="task", payload={"goal": "g"}))
    row = claim(store)
    made: Completion[Findings] = llm_for(store, row).complete(PROMPT, schema=Findings)
    assert isinstance(made.output, Findings) and not made.replayed
    assert made.output.model_dump(mode="json") == made.data

    # The worker died; the next delivery's same call is served from the record.
    expire_leases(store)
    store.hygiene.reap(max_delivery=10)
    again = claim(store)
    replayed = llm_for(store, again).complete(PROMPT, schema=Findings)
    assert replayed.replayed and replayed.output == made.output

    text = llm_for(store, again).complete("Say hello")
    assert text.output == text.text and text.data is None
