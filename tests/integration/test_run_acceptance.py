"""`orgchart run` end to end, as a user runs it: real processes, a real database.

The offline backend, an Ollama-compatible server on loopback through the real `ollama`
client, record and replay, bad input refused with exit 2 and no row written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from runtime.store.postgres import urls
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
GOAL = "Assess the market for durable agent runtimes"


def orgchart(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli.app", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def count_tasks(db_url: str) -> int:
    with psycopg.connect(urls.libpq_url(db_url)) as conn:
        return int(conn.execute("SELECT count(*) FROM tasks").fetchone()[0])


def nodes(tree: dict[str, Any]) -> list[dict[str, Any]]:
    out = [tree]
    for child in tree["children"]:
        out += nodes(child)
    return out


def shape(tree: dict[str, Any]) -> Any:
    return (tree["agent"], tree["status"],
            sorted((shape(c) for c in tree["children"]), key=str))


def test_run_drives_the_seed_org_to_done_offline(orgchart_env: dict[str, str]) -> None:
    res = orgchart(orgchart_env, "run", GOAL, "--json")
    assert res.returncode == 0, res.stderr
    tree = json.loads(res.stdout)
    assert shape(tree) == ("ceo", "done", [("intel_director", "done", sorted(
        [("competitor_scout", "done", []), ("market_researcher", "done", []),
         ("trend_analyst", "done", [])], key=str))])
    assert tree["result"]["offline"] is True
    every = nodes(tree)
    assert all(n["own_tokens"] > 0 and n["verdict"]["passed"] for n in every
               if n["agent"] != "intel_director" or n["own_tokens"])
    assert tree["totals"]["tasks"] == 5
    assert tree["totals"]["spent_tokens"] == sum(n["own_tokens"] for n in every)
    assert tree["spent_tokens"] == tree["totals"]["spent_tokens"]
    assert Decimal(tree["spent_usd"]) == sum(Decimal(n["own_usd"]) for n in every)
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("critical path ") and "(ceo > intel_director > " in last, last


def test_agents_json_lists_the_seed_org_and_human_with_schemas(
        orgchart_env: dict[str, str]) -> None:
    res = orgchart(orgchart_env, "agents", "--json")
    assert res.returncode == 0, res.stderr
    agents = {a["name"]: a for a in json.loads(res.stdout)}
    assert set(agents) == {"ceo", "intel_director", "competitor_scout", "market_researcher",
                           "trend_analyst", "judge", "pairwise_judge", "human"}
    assert all(a["input_schema"]["type"] == "object" and a["output_schema"]["properties"]
               for name, a in agents.items() if name != "human")
    # A person answers whatever the question's own answer_schema asks for.
    assert "question" in agents["human"]["input_schema"]["properties"]
    assert agents["intel_director"]["delegates_to"] == ["competitor_scout",
                                                        "market_researcher", "trend_analyst"]


def test_run_through_an_ollama_server_charges_what_it_reported(
        orgchart_env: dict[str, str], fake_ollama: FakeOllama) -> None:
    env = {**orgchart_env, "ORGCHART_LLM__BACKEND": "ollama",
           "ORGCHART_OLLAMA__URL": fake_ollama.url}
    res = orgchart(env, "run", GOAL, "--json")
    assert res.returncode == 0, res.stderr
    tree = json.loads(res.stdout)
    assert tree["status"] == "done"
    assert fake_ollama.chats > 0
    assert tree["spent_tokens"] == fake_ollama.prompt_tokens + fake_ollama.completion_tokens
    for node in nodes(tree):
        if node["own_tokens"]:
            expected_model = {"local": "llama3.2:latest", "cloud": "qwen3:14b"}[node["route"]]
            rate = {"local": Decimal("0.00001"), "cloud": Decimal("0.0001")}[node["route"]]
            assert node["model"] == expected_model
            # One route per node here; the cost is its tokens at that route's rate.
            assert Decimal(node["own_usd"]) == node["own_tokens"] * rate
    assert tree["result"]["offline"] is False


def test_a_missing_model_ends_the_run_with_exit_1_and_says_not_found(
        orgchart_env: dict[str, str], fake_ollama: FakeOllama) -> None:
    fake_ollama.models = ["something-else:latest"]
    env = {**orgchart_env, "ORGCHART_LLM__BACKEND": "ollama",
           "ORGCHART_OLLAMA__URL": fake_ollama.url}
    res = orgchart(env, "run", GOAL, "--json")
    assert res.returncode == 1, res.stderr
    tree = json.loads(res.stdout)
    assert tree["status"] in ("failed", "escalated")
    errors = " ".join(str(n["error"]) for n in nodes(tree))
    assert "not found" in errors and "qwen3:14b" in errors
    assert "Traceback" not in res.stderr


def test_a_recorded_run_replays_to_the_same_tree(orgchart_env: dict[str, str],
                                                 tmp_path: Path) -> None:
    first = orgchart(orgchart_env, "run", GOAL, "--json")
    assert first.returncode == 0, first.stderr
    original = json.loads(first.stdout)
    record = tmp_path / "run.jsonl"
    rec = orgchart(orgchart_env, "llm", "record", original["id"], "--out", str(record))
    assert rec.returncode == 0, rec.stderr
    env = {**orgchart_env, "ORGCHART_LLM__BACKEND": "replay",
           "ORGCHART_LLM__REPLAY_FILE": str(record)}
    again = orgchart(env, "run", GOAL, "--json")
    assert again.returncode == 0, again.stderr
    replayed = json.loads(again.stdout)
    assert shape(replayed) == shape(original)
    assert replayed["result"] == original["result"]
    assert replayed["spent_tokens"] == original["spent_tokens"]


@pytest.mark.parametrize("args", [
    ["run", GOAL, "--agent", "inteldirector"],
    ["submit", GOAL, "--payload", "{not json"],
    ["submit", GOAL, "--success", "[1, 2"],
    ["submit", GOAL, "--success", '{"checks": [{"path": "a", "op": "~~", "value": 1}]}'],
    ["submit", GOAL, "--budget-tokens", "-5"],
    ["submit", ""],
])
def test_bad_input_exits_2_and_writes_nothing(orgchart_env: dict[str, str], db_url: str,
                                               args: list[str]) -> None:
    res = orgchart(orgchart_env, *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "error:" in res.stderr and "Traceback" not in res.stderr
    assert count_tasks(db_url) == 0


def test_unknown_agent_suggests_the_closest(orgchart_env: dict[str, str]) -> None:
    res = orgchart(orgchart_env, "submit", GOAL, "--agent", "inteldirector")
    assert res.returncode == 2
    assert "did you mean 'intel_director'" in res.stderr


def test_a_5mb_goal_is_refused_with_exit_2_and_no_row(orgchart_env: dict[str, str],
                                                      db_url: str, tmp_path: Path) -> None:
    big = "x" * (5 * 1024 * 1024)
    # Too long for argv on some systems: pass it through the payload file of a shell.
    script = tmp_path / "big.py"
    script.write_text(
        "import sys\nfrom runtime.cli.app import main\n"
        f"sys.argv = ['orgchart', 'submit', open({str(tmp_path / 'goal.txt')!r}).read()]\n"
        "main()\n")
    (tmp_path / "goal.txt").write_text(big)
    res = subprocess.run([sys.executable, str(script)], env=orgchart_env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "limit" in res.stderr
    assert count_tasks(db_url) == 0


def test_an_unmeetable_success_schema_ends_the_root_failed_with_a_verdict(
        orgchart_env: dict[str, str]) -> None:
    success = json.dumps({"schema": {"type": "object", "required": ["impossible_field"]}})
    res = orgchart(orgchart_env, "run", GOAL, "--success", success, "--json")
    assert res.returncode == 1, res.stderr
    tree = json.loads(res.stdout)
    assert tree["status"] == "failed"
    assert tree["verdict"]["passed"] is False
    assert any("impossible_field" in r for r in tree["verdict"]["reasons"])


def test_idempotent_submit_returns_the_same_task(orgchart_env: dict[str, str],
                                                 db_url: str) -> None:
    a = orgchart(orgchart_env, "submit", GOAL, "--idempotency-key", "k1", "--json")
    b = orgchart(orgchart_env, "submit", GOAL, "--idempotency-key", "k1", "--json")
    c = orgchart(orgchart_env, "submit", "another goal", "--idempotency-key", "k1")
    assert a.returncode == b.returncode == 0
    assert json.loads(a.stdout)["id"] == json.loads(b.stdout)["id"]
    assert c.returncode == 2 and "already used" in c.stderr
    assert count_tasks(db_url) == 1


def test_run_without_a_database_url_uses_the_embedded_server(open_tmp: Path) -> None:
    if os.environ.get("ORGCHART_TEST_DATABASE_URL"):
        pytest.skip("runs on the embedded pass only")
    tmp_path = open_tmp
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ORGCHART_") and k != "DATABASE_URL"}
    # No Ollama, and no embedded model even where its extra is installed (CI's machine):
    # auto falls back to offline.
    env.update({"ORGCHART_HOME": str(tmp_path / "home"), "ORGCHART_LLM__BACKEND": "auto",
                "ORGCHART_OLLAMA__URL": "http://127.0.0.1:9",
                "ORGCHART_EMBEDDED__MODEL": str(tmp_path / "no-model.gguf")})
    res = orgchart(env, "run", GOAL, "--json", timeout=180)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["status"] == "done"
    assert "offline" in res.stderr  # auto says which backend it chose and why
    assert (tmp_path / "home" / "pgdata" / "PG_VERSION").exists()
