"""The tree page shows a task's tool calls: listed under the task, drawn on the waterfall.

A trend analyst runs offline (its notes tool is called once); the page, in a real
headless Chromium, lists the call when "steps and tool calls" is opened and draws it as
a ``wf-tool`` segment of the task's bar.
"""

from __future__ import annotations

from typing import Any

from runtime.wiring import Runtime
from tests.integration.test_browser import (  # noqa: F401
    ARTIFACTS,
    TIMEOUT_MS,
    browser,
    drain,
    pytestmark,
    runtime,
    serve,
    submit,
)


def test_the_page_lists_and_draws_a_tasks_tool_calls(browser: Any,  # noqa: F811
                                                     runtime: Runtime) -> None:  # noqa: F811
    root = submit(runtime, "durable agent runtimes", "trend_analyst")
    drain(runtime)
    assert runtime.store.reads.get(root)["status"] == "done"
    with serve(runtime) as server:
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{server.url}/ui/trees/{root}")
        page.wait_for_selector('#root-status[data-status="done"]', timeout=TIMEOUT_MS)
        page.click(f'li.node[data-task-id="{root}"] > details.steps > summary')
        item = page.wait_for_selector(
            f'li.node[data-task-id="{root}"] > details.steps li[data-kind="tool"]',
            timeout=TIMEOUT_MS)
        assert "tool search_trend_notes" in (item.text_content() or "")
        bar = page.wait_for_selector(".wf-tool", timeout=TIMEOUT_MS)
        assert "tool search_trend_notes" in (bar.get_attribute("title") or "")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "tree_tools.png"), full_page=True)
        assert errors == []
        page.close()
