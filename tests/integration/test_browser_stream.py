"""The tree page shows a task's model text as it grows (EventSource on the tree stream).

Real headless Chromium against uvicorn on the test database, as ``test_browser.py``
(skipped the same way without Chromium or playwright). Pieces are written into
``call_text`` as the model layer writes them, while the page is open.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from runtime.store.rows import NewTask
from runtime.wiring import Runtime
from tests.integration.test_browser import (
    ARTIFACTS,
    CHROMIUM,
    TIMEOUT_MS,
    browser,  # noqa: F401  (the fixture)
    runtime,  # noqa: F401  (the fixture)
    serve,
)
from tests.integration.test_stream import _piece

pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing"),
]


def test_the_tree_page_shows_text_as_it_grows(browser: Any, runtime: Runtime) -> None:  # noqa: F811
    task, _ = runtime.store.tasks.submit(NewTask("echo", "task", {"goal": "stream on the page"}))
    root = uuid.UUID(str(task["id"]))
    ARTIFACTS.mkdir(exist_ok=True)
    with serve(runtime, token="s3cret") as server:
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{server.url}/ui/trees/{root}?token=s3cret")
        page.wait_for_selector('#root-status[data-status="pending"]', timeout=TIMEOUT_MS)
        body = f'li.node[data-task-id="{root}"] > .live-text pre'
        text = ""
        for word in ["Streams ", "grow ", "on the ", "page."]:
            _piece(runtime.store, root, word, len(text))
            text += word
            page.wait_for_function(
                "([sel, want]) => { const e = document.querySelector(sel);"
                " return e !== null && e.textContent === want; }",
                arg=[body, text], timeout=TIMEOUT_MS)
        assert page.text_content(f'li.node[data-task-id="{root}"] .live-label') == "run call 0"
        # A newer attempt replaces the text shown.
        _piece(runtime.store, root, "Again", 0, attempt=2)
        page.wait_for_function(
            "([sel]) => { const e = document.querySelector(sel);"
            " return e !== null && e.textContent === 'Again'; }",
            arg=[body], timeout=TIMEOUT_MS)
        page.screenshot(path=str(ARTIFACTS / "tree-live-text.png"))
        runtime.store.steering.cancel(root, actor="test")
        page.wait_for_selector('#root-status[data-status="cancelled"]', timeout=TIMEOUT_MS)
        page.wait_for_selector(body, state="detached", timeout=TIMEOUT_MS)
        assert errors == []
