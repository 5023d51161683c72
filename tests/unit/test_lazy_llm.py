"""``ctx.llm`` is built on first use (runtime.engine.started.LazyLLM)."""

from __future__ import annotations

import threading
from typing import Any

from runtime.engine.started import LazyLLM, built_llm, check_tools_with


class Handle:
    def __init__(self) -> None:
        self.budget = "the budget"
        self.tool_check: Any = None

    def complete(self, prompt: str) -> str:
        return f"answer to {prompt}"


def test_nothing_is_built_until_the_handle_is_used() -> None:
    made: list[Handle] = []
    llm = LazyLLM(lambda: made.append(Handle()) or made[-1])
    assert made == [] and built_llm(llm) is None
    assert llm.complete("q") == "answer to q"
    assert len(made) == 1 and built_llm(llm) is made[0]
    assert llm.budget == "the budget" and len(made) == 1  # built once


def test_writes_go_to_the_handle() -> None:
    llm = LazyLLM(Handle)
    llm.tool_check = "checked"
    assert built_llm(llm).tool_check == "checked"


def test_threads_share_one_handle() -> None:
    made: list[Handle] = []
    gate = threading.Barrier(8)

    def make() -> Handle:
        made.append(Handle())
        return made[-1]

    llm = LazyLLM(make)
    seen: list[Any] = []

    def use() -> None:
        gate.wait()
        seen.append(llm.budget and built_llm(llm))

    threads = [threading.Thread(target=use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(s is made[0] for s in seen)


def test_a_plain_handle_is_its_own_built_one() -> None:
    handle = Handle()
    assert built_llm(handle) is handle


def test_the_tool_check_asks_the_policies() -> None:
    class Rules:
        def validate_tool(self, task: Any, tool: str) -> str | None:
            return None if tool == "search" else f"{tool} is not allowed"

    handle = Handle()
    check_tools_with(handle, Rules(), view=None)  # type: ignore[arg-type]
    assert handle.tool_check("search") is None
    assert handle.tool_check("shell") == "shell is not allowed"
