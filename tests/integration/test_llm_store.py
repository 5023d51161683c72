"""TaskLLM against a real PostgreSQL: charging, budgets, prices, leases, recording and replay."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from runtime.cli.app import app
from runtime.config import Settings
from runtime.engine.store_ledger import StoreLedger
from runtime.errors import (
    BudgetExceeded,
    LeaseLost,
    ModelNotFound,
    TransientModelError,
    UnknownPrice,
)
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.backends.ollama import OllamaBackend
from runtime.llm.backends.replay import ReplayBackend, records_from_calls, write_replay_file
from runtime.llm.handle import LLMFactory, TaskLLM
from runtime.llm.reply import BadModelReply
from runtime.store.rows import ChildRow, NewTask, RunOutcome
from runtime.store.store import Store
from tests.factories import hand_over
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

PROMPT = "Name two competitors of Acme Robotics"


class Findings(BaseModel):
    competitors: list[str] = Field(min_length=2, max_length=4)
    confidence: float = Field(ge=0, le=1)


def make_settings(**sections: Any) -> Settings:
    return Settings.model_validate(sections)


def claim_new(store: Store, **budget: Any) -> dict[str, Any]:
    store.tasks.submit(NewTask(to_agent="scout", type="task", payload={"goal": "g"}, **budget))
    (row,) = store.claims.claim(["scout"], 1, "w", 30)
    return row


def llm_for(store: Store, row: dict[str, Any], settings: Settings | None = None,
            backend: Any = None, token: uuid.UUID | None = None,
            lost: threading.Event | None = None) -> TaskLLM:
    factory = LLMFactory(settings or make_settings(), StoreLedger(store),
                         backend=backend or OfflineBackend(), announcement="test")
    return factory.for_task(row, token or row["lease_token"], lost or threading.Event())


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_complete_charges_the_task_and_records_the_call(store: Store) -> None:
    row = claim_new(store)
    llm = llm_for(store, row)
    reply = llm.complete(PROMPT, schema=Findings)
    Findings.model_validate(reply.data)
    assert reply.offline and reply.backend == "offline"
    assert (reply.route, reply.model) == ("local", "llama3.2:latest")
    tokens = reply.prompt_tokens + reply.completion_tokens
    assert reply.cost_usd == tokens * Decimal("0.00001")
    task = store.reads.get(row["id"])
    assert task["spent_tokens"] == task["own_tokens"] == tokens
    assert task["spent_usd"] == task["own_usd"] == reply.cost_usd
    assert (task["route"], task["model"]) == ("local", "llama3.2:latest")
    assert task["route_reason"].startswith("prompt 37 chars <= prompt_threshold 100")
    (call,) = store.reads.model_calls(row["id"])
    assert (call["attempt"], call["call_index"], call["backend"]) == (1, 0, "offline")
    assert call["prompt"].startswith(PROMPT + "\n\n[format] json schema Findings")
    assert json.loads(call["response"]) == reply.data
    assert (call["prompt_tokens"], call["completion_tokens"]) == (reply.prompt_tokens,
                                                                  reply.completion_tokens)
    assert call["cost_usd"] == reply.cost_usd and call["error"] is None
    second = llm.complete("And a third one?")
    assert second.call_index == 1 and second.text.startswith("offline: And a third")
    assert store.reads.get(row["id"])["spent_tokens"] == tokens + second.prompt_tokens \
        + second.completion_tokens
    assert llm.remaining_tokens() == 50_000 - store.reads.get(row["id"])["spent_tokens"]


def test_token_counts_match_what_the_ollama_server_reported(store: Store,
                                                            fake_ollama: FakeOllama) -> None:
    row = claim_new(store)
    llm = llm_for(store, row, backend=OllamaBackend(fake_ollama.url, 5.0))
    first = llm.complete(PROMPT, schema=Findings, system="Answer in JSON.")
    llm.complete("x" * 150)  # long prompt: the cloud route
    assert first.backend == "ollama" and not first.offline
    task = store.reads.get(row["id"])
    assert task["spent_tokens"] == fake_ollama.prompt_tokens + fake_ollama.completion_tokens
    assert [r["model"] for r in fake_ollama.requests] == ["llama3.2:latest", "qwen3:14b"]
    assert (task["route"], task["model"]) == ("cloud", "qwen3:14b")
    assert task["route_reason"] == "prompt 150 chars > prompt_threshold 100"
    calls = store.reads.model_calls(row["id"])
    assert sum(c["cost_usd"] for c in calls) == task["spent_usd"]
    assert calls[1]["cost_usd"] == (calls[1]["prompt_tokens"] + calls[1]["completion_tokens"]) \
        * Decimal("0.0001")


def test_deep_pending_queue_routes_to_the_cloud(store: Store) -> None:
    row = claim_new(store)
    store.tasks.submit_many("someone", "task", [{"goal": str(i)} for i in range(6)])
    reply = llm_for(store, row).complete("short")
    assert (reply.route, reply.model) == ("cloud", "qwen3:14b")
    assert reply.route_reason == "pending queue 6 > pending_threshold 5"


def test_spend_rolls_up_to_the_parent_when_the_child_ends(store: Store) -> None:
    parent = claim_new(store, budget_tokens=10_000)
    store.transitions.delegate(parent["id"], parent["lease_token"],
                               [ChildRow("kid", "task", {"goal": "c"}, "k1", 4000, 60,
                                         Decimal("0.5"))], "w")
    (child,) = store.claims.claim(["kid"], 1, "w", 30)
    reply = llm_for(store, child).complete(PROMPT)
    tokens = reply.prompt_tokens + reply.completion_tokens
    # A charge touches only its own task; the tree's live spend is summed from its calls.
    assert store.reads.get(parent["id"])["spent_tokens"] == 0
    assert store.spend.live(parent["root_id"])[0] == tokens
    store.transitions.finish_running([RunOutcome(child.id, child.lease_token, "failed",
                                                 error="x")], "w")
    assert store.reads.get(parent["id"])["spent_tokens"] == tokens
    assert store.reads.get(parent["id"])["own_tokens"] == 0


def test_budget_overrun_is_refused_before_anything_is_spent(store: Store,
                                                            fake_ollama: FakeOllama) -> None:
    row = claim_new(store, budget_tokens=30)
    llm = llm_for(store, row, backend=OllamaBackend(fake_ollama.url, 5.0))
    with pytest.raises(BudgetExceeded, match=r"^budget: .*budget_tokens 30") as err:
        llm.complete("word " * 30)
    assert "prompt" in str(err.value)
    assert fake_ollama.chats == 0
    task = store.reads.get(row["id"])
    assert task["spent_tokens"] == 0 and task["spent_usd"] == 0
    assert store.reads.model_calls(row["id"]) == []


def test_max_tokens_shrinks_to_what_the_budget_leaves(store: Store,
                                                      fake_ollama: FakeOllama) -> None:
    row = claim_new(store, budget_tokens=100)
    llm = llm_for(store, row, backend=OllamaBackend(fake_ollama.url, 5.0))
    llm.complete("one two three", max_tokens=500)
    assert fake_ollama.requests[0]["options"]["num_predict"] == 100 - 4


def test_usd_budget_is_checked_with_the_routes_price(store: Store) -> None:
    row = claim_new(store, budget_usd=Decimal("0.001"))
    settings = make_settings(cost={"local_per_token": "0.0001"})
    expected = r"at \$0.0001/token but \$0.0010 of budget_usd \$0.0010 is left"
    with pytest.raises(BudgetExceeded, match=expected):
        llm_for(store, row, settings).complete("word " * 20)
    assert store.reads.get(row["id"])["spent_usd"] == 0


def test_unknown_price_is_refused_and_names_the_model_and_key(store: Store) -> None:
    row = claim_new(store)
    settings = make_settings(cost={"local_per_token": ""})
    with pytest.raises(UnknownPrice, match=r"'llama3.2:latest'.*cost\.local_per_token"):
        llm_for(store, row, settings).complete(PROMPT)
    assert store.reads.get(row["id"])["spent_tokens"] == 0


def test_per_model_price_wins_over_the_route_rate(store: Store) -> None:
    row = claim_new(store)
    settings = make_settings(cost={"local_per_token": "", "prices": {"llama3.2:latest": "0.0005"}})
    reply = llm_for(store, row, settings).complete(PROMPT)
    assert reply.cost_usd == (reply.prompt_tokens + reply.completion_tokens) * Decimal("0.0005")


def test_lost_lease_stops_the_call(store: Store) -> None:
    row = claim_new(store)
    lost = threading.Event()
    lost.set()
    with pytest.raises(LeaseLost):
        llm_for(store, row, lost=lost).complete(PROMPT)
    # Another holder's token: the start gate refuses before the model is called.
    with pytest.raises(LeaseLost, match="taken away; the model was not called"):
        llm_for(store, row, token=uuid.uuid4()).complete(PROMPT)
    assert store.reads.get(row["id"])["spent_tokens"] == 0
    assert store.reads.model_calls(row["id"]) == []


def test_a_lease_taken_during_the_call_drops_its_answer(store: Store,
                                                        fake_ollama: FakeOllama) -> None:
    """The gate let the call through; the lease changed hands while it was in flight."""
    row = claim_new(store)
    fake_ollama.delay_seconds = 0.5
    llm = llm_for(store, row, backend=OllamaBackend(fake_ollama.url, 5.0))
    raised: list[BaseException] = []

    def call() -> None:
        try:
            llm.complete(PROMPT)
        except BaseException as exc:  # read by the test below
            raised.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 10
    while fake_ollama.received < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    hand_over(store, row["id"])
    thread.join(10)
    assert fake_ollama.received == 1
    assert len(raised) == 1 and isinstance(raised[0], LeaseLost)
    assert "not charged" in str(raised[0])
    assert store.reads.get(row["id"])["spent_tokens"] == 0
    assert store.reads.model_calls(row["id"]) == []


def test_failed_calls_are_recorded_with_their_error(store: Store,
                                                    fake_ollama: FakeOllama) -> None:
    row = claim_new(store)
    settings = make_settings(models={"local": "missing:1b"})
    with pytest.raises(ModelNotFound, match="missing:1b"):
        llm_for(store, row, settings, OllamaBackend(fake_ollama.url, 5.0)).complete(PROMPT)
    fast = make_settings(llm={"call_retries": 1, "retry_base_seconds": 0.01})
    with pytest.raises(TransientModelError, match="gave up after 2 request"):
        llm_for(store, row, fast, OllamaBackend(closed_port_url(), 2.0)).complete(PROMPT)
    fake_ollama.reply_text = "not json"
    with pytest.raises(BadModelReply, match=r"in 3 attempt\(s\)"):
        llm_for(store, row, backend=OllamaBackend(fake_ollama.url, 5.0)).complete(
            PROMPT, schema=Findings)
    calls = store.reads.model_calls(row["id"])
    assert [c["error"].split(":")[0] for c in calls] == [
        "ModelNotFound", "TransientModelError", "TransientModelError",
        "BadModelReply", "BadModelReply", "BadModelReply"]
    assert [c["attempt_kind"] for c in calls] == ["call", "call", "retry", "call", "repair",
                                                  "repair"]
    assert [c["call_try"] for c in calls] == [1, 1, 2, 1, 2, 3]
    assert calls[0]["response"] is None and calls[0]["prompt_tokens"] == 0
    # The bad replies still used tokens, and they are charged; the retries cost nothing.
    bad = calls[3:]
    assert all(c["response"] == "not json" and c["completion_tokens"] > 0 for c in bad)
    assert store.reads.get(row["id"])["spent_tokens"] == sum(
        c["prompt_tokens"] + c["completion_tokens"] for c in bad)
    # Each repair carried the bad reply and the error back to the model.
    repair = fake_ollama.requests[-1]["messages"]
    assert [m["role"] for m in repair] == ["user", "assistant", "user"]
    assert repair[1]["content"] == "not json" and "Your reply failed" in repair[2]["content"]


def test_record_and_replay_give_the_same_answers(store: Store, tmp_path: Path) -> None:
    row = claim_new(store)
    llm = llm_for(store, row)
    original = [llm.complete(PROMPT, schema=Findings), llm.complete("Summarise them"),
                llm.complete(PROMPT, schema=Findings, system="Be terse.")]
    calls = store.database.query("model_call_list_tree", root_id=row["root_id"])
    path = tmp_path / "run.jsonl"
    assert write_replay_file(path, records_from_calls(calls)) == 3
    again = claim_new(store)
    replayed = llm_for(store, again, backend=ReplayBackend(path))
    answers = [replayed.complete(PROMPT, schema=Findings), replayed.complete("Summarise them"),
               replayed.complete(PROMPT, schema=Findings, system="Be terse.")]
    assert [a.data for a in answers] == [o.data for o in original]
    assert [a.text for a in answers] == [o.text for o in original]
    assert {a.backend for a in answers} == {"replay"}
    assert all(a.offline for a in answers)  # recorded offline: still labelled offline
    assert (store.reads.get(again["id"])["spent_tokens"]
            == store.reads.get(row["id"])["spent_tokens"])


def test_cli_record_writes_a_replay_file_and_check_says_why(
        store: Store, orgchart_env: dict[str, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    row = claim_new(store)
    llm_for(store, row).complete(PROMPT, schema=Findings)
    runner = CliRunner()
    out = tmp_path / "tree.jsonl"
    result = runner.invoke(app, ["llm", "record", str(row["id"]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote 1 responses from 1 model calls of 1 tasks in tree {row['id']}" in result.output
    assert json.loads(out.read_text().splitlines()[0])["route"] == "local"
    bad = runner.invoke(app, ["llm", "record", "not-a-uuid", "--out", str(out)])
    assert bad.exit_code == 2 and "is not a UUID" in bad.output
    missing = runner.invoke(app, ["llm", "record", str(uuid.uuid4()), "--out", str(out)])
    assert missing.exit_code == 2 and "no task" in missing.output
    check = runner.invoke(app, ["llm", "check", "--json"])
    assert check.exit_code == 0
    assert json.loads(check.output)["backend"] == "offline"
    monkeypatch.setenv("ORGCHART_LLM__BACKEND", "auto")
    monkeypatch.setenv("ORGCHART_OLLAMA__URL", closed_port_url())
    check = runner.invoke(app, ["llm", "check"])
    assert "no Ollama answered at http://127.0.0.1:" in check.output


def test_record_false_keeps_the_accounting_but_not_the_text(store: Store) -> None:
    row = claim_new(store)
    reply = llm_for(store, row, make_settings(llm={"record": False})).complete(PROMPT)
    (call,) = store.reads.model_calls(row["id"])
    assert call["prompt"].startswith("[not recorded] request ")
    assert call["response"] is None
    assert call["prompt_tokens"] == reply.prompt_tokens
    assert records_from_calls([call]) == []
