"""The tree page says which backend served each task's calls, and marks estimated costs.

A trend analyst runs on the offline backend: its calls are charged at the routed model's
price though no model ran, so the page reads ``offline (est.)`` beside the task (not
``local:qwen3:0.6b``) and the totals say the calls were served offline, at an estimate.
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


def test_the_page_says_offline_est_instead_of_a_model_that_never_ran(
        browser: Any, runtime: Runtime) -> None:  # noqa: F811
    root = submit(runtime, "durable agent runtimes", "trend_analyst")
    drain(runtime)
    task = runtime.store.reads.get(root)
    assert task["status"] == "done" and task["served_by"] == {"offline": 2}
    with serve(runtime) as server:
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{server.url}/ui/trees/{root}")
        page.wait_for_selector('#root-status[data-status="done"]', timeout=TIMEOUT_MS)
        served = page.wait_for_selector(f'li.node[data-task-id="{root}"] > .line .served',
                                        timeout=TIMEOUT_MS)
        assert served.text_content() == "offline (est.)"
        assert "estimated" in (served.get_attribute("class") or "")
        assert "did not run" in (served.get_attribute("title") or "")
        assert page.locator(f'li.node[data-task-id="{root}"] > .line .route').count() == 0
        totals = page.text_content("#totals") or ""
        assert "served by offline 2 calls (" in totals and " est.)" in totals
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "tree_served_by.png"), full_page=True)
        assert errors == []
        page.close()
