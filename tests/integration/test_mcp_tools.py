"""MCP tools: a server of our own over stdio, its tools listed and called as durable steps."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agents.tools import BadToolArguments
from runtime.cli.app import app
from runtime.config import Settings
from runtime.engine.store_ledger import StoreLedger
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.handle import LLMFactory
from runtime.llm.mcp_tools import McpToolError, McpToolSource, McpUnavailable
from runtime.store.rows import NewTask
from runtime.store.store import Store

SERVER = str(Path(__file__).resolve().parents[1] / "mcp_notes_server.py")


def mcp_settings(log: Path | None = None, **env: str) -> Settings:
    env = {"MCP_NOTES_LOG": str(log), **env} if log else env
    return Settings.model_validate({"mcp": {"servers": {"notes": {
        "command": [sys.executable, SERVER], "env": env, "agents": ["trend_analyst"],
        "timeout_seconds": 20}}}})


@pytest.fixture
def source(tmp_path: Path) -> Iterator[McpToolSource]:
    made = McpToolSource(mcp_settings(tmp_path / "calls.log"))
    yield made
    made.close()


def test_the_servers_tools_come_with_their_schemas(source: McpToolSource) -> None:
    tools = {t.name: t for t in source.tools_for("trend_analyst")}
    assert sorted(tools) == ["count_words", "lookup_note", "refuse"]
    assert source.tools_for("ceo") == ()
    schema = tools["count_words"].json_schema
    assert schema["required"] == ["text"] and schema["properties"]["minimum"]["type"] == "integer"
    assert tools["lookup_note"].source == "mcp:notes" and tools["lookup_note"].is_async
    with pytest.raises(BadToolArguments, match="text"):
        tools["count_words"].validate({"minimum": 2})


def test_mcp_tools_run_as_durable_steps_in_the_tool_loop(
        store: Store, source: McpToolSource, tmp_path: Path) -> None:
    store.tasks.submit(NewTask(to_agent="scout", type="task", payload={"goal": "g"}))
    (row,) = store.claims.claim(["scout"], 1, "w", 30)
    factory = LLMFactory(Settings(), StoreLedger(store), backend=OfflineBackend(),
                         announcement="test")
    llm = factory.for_task(row, row["lease_token"], threading.Event())
    lookup = next(t for t in source.tools_for("trend_analyst") if t.name == "lookup_note")
    reply = llm.complete("What is durable execution about?", tools=[lookup])
    (outcome,) = reply.tool_results
    assert outcome.error is None and outcome.name == "lookup_note"
    (step,) = store.steps.for_task(row["id"])
    assert (step["kind"], step["status"], step["result"]) == ("tool", "finished", outcome.result)
    assert (tmp_path / "calls.log").read_text().count("\n") == 1
    factory.close()


def test_an_mcp_tool_error_raises_with_the_servers_message(source: McpToolSource) -> None:
    import asyncio

    refuse = next(t for t in source.tools_for("trend_analyst") if t.name == "refuse")
    with pytest.raises(McpToolError, match="not today"):
        asyncio.run(refuse.fn(reason="not today"))
    count = next(t for t in source.tools_for("trend_analyst") if t.name == "count_words")
    assert asyncio.run(count.fn(text="a bb ccc", minimum=2)) == 2


def test_orgchart_agents_shows_the_mcp_tools(tmp_path: Path, monkeypatch: Any,
                                             orgchart_env: dict[str, str]) -> None:
    config = tmp_path / "orgchart.toml"
    config.write_text(f'[mcp.servers.notes]\ncommand = [{json.dumps(sys.executable)}, '
                      f'{json.dumps(SERVER)}]\nagents = ["trend_analyst"]\n')
    env = {**orgchart_env, "ORGCHART_CONFIG": str(config)}
    result = CliRunner().invoke(app, ["agents", "--json"], env=env)
    assert result.exit_code == 0, result.output
    by_name = {a["name"]: a for a in json.loads(result.output)}
    names = [t["name"] for t in by_name["trend_analyst"]["tools"]]
    assert {"lookup_note", "count_words", "refuse"} <= set(names)
    assert by_name["ceo"]["tools"] == []


def test_an_mcp_server_naming_an_unknown_agent_is_a_config_error(
        tmp_path: Path, orgchart_env: dict[str, str]) -> None:
    config = tmp_path / "orgchart.toml"
    config.write_text('[mcp.servers.notes]\ncommand = ["python"]\nagents = ["trend_analist"]\n')
    result = CliRunner().invoke(app, ["agents"],
                                env={**orgchart_env, "ORGCHART_CONFIG": str(config)})
    assert result.exit_code == 2 and "trend_analyst" in result.output


def test_a_killed_server_is_started_again_by_the_next_call(tmp_path: Path) -> None:
    pids, no_start = tmp_path / "pids", tmp_path / "no-start"
    source = McpToolSource(mcp_settings(tmp_path / "calls.log", MCP_NOTES_PIDS=str(pids),
                                        MCP_NOTES_NO_START=str(no_start)))
    try:
        count = next(t for t in source.tools_for("trend_analyst") if t.name == "count_words")
        assert asyncio.run(count.fn(text="one two three")) == 3
        first = int(pids.read_text().split()[0])
        os.kill(first, signal.SIGKILL)
        wait_gone(first)
        # The next call finds the process gone, starts another, and runs on it.
        assert asyncio.run(count.fn(text="four five")) == 2
        assert len(pids.read_text().split()) == 2 and source.restarts == {"notes": 1}
        # A server that keeps dying: a bounded number of starts, then a clear error.
        no_start.touch()
        os.kill(int(pids.read_text().split()[-1]), signal.SIGKILL)
        with pytest.raises(McpUnavailable, match=r"'notes' .* keeps dying: 3 starts failed"):
            asyncio.run(count.fn(text="six"))
        no_start.unlink()
        assert asyncio.run(count.fn(text="seven eight nine ten")) == 4
        assert len(pids.read_text().split()) == 3 and source.restarts == {"notes": 2}
    finally:
        source.close()


def wait_gone(pid: int) -> None:
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
