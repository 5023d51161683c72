"""The tree page steers a tree in a real headless Chromium: cancel, answer, approve.

Same harness as test_browser.py (uvicorn on the test database, /usr/bin/chromium through
Playwright); skipped when either is missing. Screenshots land in ``tests/artifacts/``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from runtime.config import load_settings
from runtime.store.rows import NewTask
from runtime.store.store import Store
from runtime.wiring import Runtime, build_runtime
from tests.factories import parent_with_children
from tests.integration.test_browser import (
    ARTIFACTS,
    CHROMIUM,
    TIMEOUT_MS,
    browser,  # noqa: F401  (the fixture)
    runtime,  # noqa: F401  (the fixture)
    serve,
)
from tests.integration.test_steering_faces import example_module  # noqa: F401

pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing"),
]


@pytest.fixture
def asking(db_url: str, store: Store, example_module: str) -> Runtime:  # noqa: F811
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "offline"})
    return build_runtime(settings, ["tests.support_agents", example_module], store=store)


def drain(rt: Runtime) -> None:
    """Step a worker until the queue is empty, in a thread (Playwright's loop runs here)."""
    def work() -> None:
        worker = rt.worker(None, maintenance=False, listen=False)
        for _ in range(50):
            if worker.run_once() == 0 and rt.store.hygiene.sweep().ready == 0:
                return

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)


def open_tree(browser: Any, server: Any, root: Any) -> Any:  # noqa: F811
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: d.accept())
    page.goto(f"{server.url}/ui/trees/{root}")
    page.errors = errors
    return page


def test_cancel_a_tree_on_the_page(browser: Any, runtime: Runtime) -> None:  # noqa: F811
    root, _ = parent_with_children(runtime.store, 3)
    ARTIFACTS.mkdir(exist_ok=True)
    with serve(runtime) as server:
        page = open_tree(browser, server, root["id"])
        page.wait_for_selector("button.steer.pause", timeout=TIMEOUT_MS)
        page.click("button.steer.pause")
        page.wait_for_selector("#paused:not([hidden])", timeout=TIMEOUT_MS)
        assert runtime.store.steering.pause_of(root["id"]) is not None
        page.click("button.steer.cancel")
        page.wait_for_selector('#root-status[data-status="cancelled"]', timeout=TIMEOUT_MS)
        page.screenshot(path=str(ARTIFACTS / "tree-cancelled.png"))
        assert page.errors == []
    assert {t["status"] for t in runtime.store.reads.tree_rows(root["id"])} == {"cancelled"}


def test_answer_a_question_on_the_page(browser: Any, asking: Runtime) -> None:  # noqa: F811
    root, _ = asking.store.tasks.submit(NewTask("publisher", "publish", {"goal": "the report"}))
    drain(asking)
    (question,) = asking.store.reads.children(root["id"])
    with serve(asking) as server:
        page = open_tree(browser, server, root["id"])
        page.wait_for_selector(f'.inbox-item[data-task-id="{question["id"]}"]',
                               timeout=TIMEOUT_MS)
        page.screenshot(path=str(ARTIFACTS / "tree-question.png"))
        page.click(f'.inbox-item[data-task-id="{question["id"]}"] button[data-choice=\'"yes"\']')
        page.wait_for_selector("#inbox[hidden]", state="attached", timeout=TIMEOUT_MS)
        assert page.errors == []
    assert asking.store.reads.get(question["id"])["result"] == "yes"
    assert asking.store.reads.get(root["id"])["status"] == "ready_to_aggregate"


def test_approve_a_task_on_the_page(browser: Any, runtime: Runtime) -> None:  # noqa: F811
    runtime.store.policies.approval_agents = ("echo",)
    root, kids = parent_with_children(runtime.store, 2)
    with serve(runtime) as server:
        page = open_tree(browser, server, root["id"])
        first = f'.inbox-item[data-task-id="{kids[0]["id"]}"]'
        page.wait_for_selector(first, timeout=TIMEOUT_MS)
        page.click(first + " button.approve")
        page.wait_for_selector(first, state="detached", timeout=TIMEOUT_MS)
        second = f'.inbox-item[data-task-id="{kids[1]["id"]}"]'
        page.fill(second + " input.note", "too costly")
        page.click(second + " button.reject")
        page.wait_for_selector(second, state="detached", timeout=TIMEOUT_MS)
        page.screenshot(path=str(ARTIFACTS / "tree-approved.png"))
        assert page.errors == []
    assert runtime.store.reads.get(kids[0]["id"])["status"] == "pending"
    failed = runtime.store.reads.get(kids[1]["id"])
    assert failed["status"] == "failed" and "too costly" in failed["error"]
