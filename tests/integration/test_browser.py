"""The live tree page in a real headless Chromium (Playwright), against uvicorn on the test DB.

Skipped when ``/usr/bin/chromium`` or the ``playwright`` package is missing (install with
``apt-get install -y chromium`` and ``pip install playwright``; ``playwright install`` is
not needed). Screenshots land in ``tests/artifacts/``.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.http.api import create_app
from runtime.store.store import Store
from runtime.wiring import Runtime, build_root
from tests.asgi_server import Server
from tests.support import drain

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
TIMEOUT_MS = 30_000

playwright_sync = pytest.importorskip("playwright.sync_api",
                                      reason="the playwright package is not installed")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason=f"{CHROMIUM} is missing (apt-get install -y chromium)"),
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime]) -> Runtime:
    return make_runtime(ORGCHART_RETRY__MAX_RETRY="0")


def serve(runtime: Runtime, token: str | None = None) -> Server:
    return Server(create_app(store=runtime.store, settings=runtime.settings,
                             registry=runtime.registry, api_token=token or ""))


def submit(runtime: Runtime, goal: str, agent: str, **payload: Any) -> uuid.UUID:
    new = build_root(runtime.registry, runtime.settings, goal=goal, agent=agent, payload=payload)
    return runtime.store.tasks.submit(new, actor="test")[0]["id"]


def test_the_tree_page_follows_a_tree_until_it_is_done(browser: Any, runtime: Runtime) -> None:
    root = submit(runtime, "Survey the market for garden robots", "fanout", n=3, sleep=0.3)
    ARTIFACTS.mkdir(exist_ok=True)
    with serve(runtime) as server:
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        # The index lists the root and links to its tree.
        page.goto(server.url + "/")
        page.wait_for_selector(f'#roots tr[data-task-id="{root}"]', timeout=TIMEOUT_MS)
        page.screenshot(path=str(ARTIFACTS / "index.png"))
        page.click(f'#roots tr[data-task-id="{root}"] a')
        page.wait_for_url(f"**/ui/trees/{root}")
        page.wait_for_selector('#root-status[data-status="pending"]', timeout=TIMEOUT_MS)
        # Drive the tree to done while the page is open.
        worker = runtime.worker(None, once=True)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        page.wait_for_selector('#root-status[data-status="done"]', timeout=TIMEOUT_MS)
        thread.join(timeout=30)
        assert page.text_content("#root-status") == "done"
        nodes = page.locator("li.node")
        assert nodes.count() == 4
        assert page.locator('li.node[data-status="done"]').count() == 4
        assert page.get_attribute(f'li.node[data-task-id="{root}"]', "data-status") == "done"
        assert "4 tasks (done 4)" in page.text_content("#totals")
        assert "Survey the market" in page.text_content("#goal")
        assert page.locator("button.resolve").count() == 0
        # The tree came in its summary shape: a node's result is read when it is opened.
        child = str(runtime.store.reads.children(root)[0]["id"])
        node = f'li.node[data-task-id="{child}"] > .extras'
        assert page.locator(f"{node} > details[data-key='result-{child}']").count() == 0
        page.click(f"{node} > details.more > summary")
        result = page.wait_for_selector(f"{node} > details[data-key='result-{child}'][open] pre",
                                        timeout=TIMEOUT_MS)
        task = runtime.store.reads.get(uuid.UUID(child))
        assert json.loads(result.text_content() or "") == task["result"]
        page.screenshot(path=str(ARTIFACTS / "tree_done.png"), full_page=True)
        assert errors == []
        page.close()


def test_escalated_nodes_get_buttons_that_resolve_them(browser: Any, runtime: Runtime) -> None:
    root = submit(runtime, "Ask the flaky scouts", "fanout", n=2, child="flaky")
    drain(runtime)
    assert runtime.store.reads.get(root)["status"] == "escalated"
    ARTIFACTS.mkdir(exist_ok=True)
    with serve(runtime, token="page-token") as server:
        page = browser.new_page(viewport={"width": 1100, "height": 600})
        denied = page.goto(f"{server.url}/ui/trees/{root}")
        assert denied is not None and denied.status == 401
        page.goto(f"{server.url}/ui/trees/{root}?token=page-token")
        page.wait_for_selector('#root-status[data-status="escalated"]', timeout=TIMEOUT_MS)
        assert page.locator('li.node[data-status="failed"]').count() == 2
        buttons = page.locator(f'button.resolve[data-task-id="{root}"]')
        assert buttons.count() == 3
        assert "2 children failed" in page.text_content(f'li.node[data-task-id="{root}"] .error')
        page.screenshot(path=str(ARTIFACTS / "tree_escalated.png"), full_page=True)
        page.click(f'button.resolve[data-task-id="{root}"][data-action="done"]')
        page.wait_for_selector('#root-status[data-status="done"]', timeout=TIMEOUT_MS)
        assert "resolved (done)" in page.text_content("#message")
        page.close()
    assert runtime.store.reads.get(root)["status"] == "done"
    assert "resolved from the web page" in runtime.store.reads.events(root)[-1]["detail"]


def test_the_waterfall_groups_siblings_and_marks_the_critical_path(browser: Any,
                                                                   runtime: Runtime) -> None:
    import re
    import time

    from runtime.views import critical_path_summary
    from tests.timed_tree import build_timed_tree

    tree = build_timed_tree(runtime.store, leads=30, writers=30)  # 931 tasks
    expected = critical_path_summary(runtime.store, tree.root)
    assert re.fullmatch(r"critical path \d+\.\d s of \d+\.\d s; \d+\.\d s queued "
                        r"\(planner > lead > wide_writer\)", expected), expected
    ARTIFACTS.mkdir(exist_ok=True)
    with serve(runtime) as server:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        t0 = time.perf_counter()
        page.goto(f"{server.url}/ui/trees/{tree.root}")
        page.wait_for_selector("#critical-summary:has-text('critical path')",
                               timeout=TIMEOUT_MS)
        print(f"931-task waterfall on screen {time.perf_counter() - t0:.2f} s after goto")
        assert page.text_content("#critical-summary") == expected
        # The path's three tasks have rows of their own, marked; their siblings are grouped.
        marked = page.locator(".wf-row.wf-critical")
        assert [marked.nth(i).get_attribute("data-task-id") for i in range(marked.count())] \
            == [str(t) for t in tree.critical]
        groups = page.locator(".wf-row.wf-group")
        names = [groups.nth(i).locator(".wf-group-name").text_content()
                 for i in range(groups.count())]
        # Depth first: the critical lead's writers, then the other leads.
        assert len(names) == 2, names
        assert re.fullmatch(r"wide_writer x 29, 1\.\d-1\.\d s", names[0] or ""), names
        assert re.fullmatch(r"lead x 29, \d\.\d-\d\.\d s", names[1] or ""), names
        assert page.get_attribute("#waterfall", "data-rows") == "5"
        segments = page.locator(f'.wf-row[data-task-id="{tree.root}"] .wf-seg')
        assert segments.count() == 6  # queued, running, waiting, queued, running, judging
        assert page.locator(f'.wf-row[data-task-id="{tree.root}"] .wf-call').count() == 1
        page.screenshot(path=str(ARTIFACTS / "waterfall_931.png"), full_page=False)
        # Opening the group of leads shows them (each lead's writers stay grouped).
        groups.nth(1).locator("button.wf-toggle").click()
        page.wait_for_function("document.getElementById('waterfall').dataset.rows !== '5'")
        rows = int(page.get_attribute("#waterfall", "data-rows") or 0)
        assert rows == 5 + 29
        page.screenshot(path=str(ARTIFACTS / "waterfall_931_leads_open.png"), full_page=False)
        assert errors == []
        page.close()


def drained(runtime: Runtime) -> None:
    """:func:`drain` in a thread (Playwright's loop runs in this one)."""
    thread = threading.Thread(target=drain, args=(runtime,))
    thread.start()
    thread.join(timeout=120)


def test_the_diff_page_compares_a_branch_with_its_original(
        browser: Any, make_runtime: Callable[..., Runtime], store: Store) -> None:
    from runtime.forks import fork

    runtime = make_runtime(["tests.fork_agents"])
    settings = runtime.settings
    original = submit(runtime, "harbour report", "fork_planner")
    drained(runtime)
    writer = next(c for c in store.reads.children(original) if c["idempotency_key"] == "w1")
    branch = fork(store, runtime.registry, settings, writer["id"],
                  payload={"goal": "the lighthouse at night"}, note="new angle")["id"]
    drained(runtime)
    ARTIFACTS.mkdir(exist_ok=True)
    with serve(runtime) as server:
        page = browser.new_page(viewport={"width": 1300, "height": 700})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        # The original's tree page lists its branch; the branch's names its origin.
        page.goto(f"{server.url}/ui/trees/{original}")
        page.wait_for_selector(f'#branches a[href^="/ui/trees/{branch}"]', timeout=TIMEOUT_MS)
        page.goto(f"{server.url}/ui/trees/{branch}")
        page.wait_for_selector("#origin a.diff-link", timeout=TIMEOUT_MS)
        page.wait_for_selector(".wf-call.wf-replayed", state="attached", timeout=TIMEOUT_MS)
        # The note comes from the branch root's own read, after the origin line is drawn.
        page.wait_for_selector('#origin:has-text("new angle")', timeout=TIMEOUT_MS)
        page.click("#origin a.diff-link")
        page.wait_for_url(f"**/ui/diff/{original}/{branch}")
        page.wait_for_selector('body[data-loaded="true"]', timeout=TIMEOUT_MS)
        rows = {r.get_attribute("data-path"): r for r in page.query_selector_all("#diff tbody tr")}
        assert sorted(rows) == ["/", "/w0", "/w1", "/w2"]
        assert rows["/w1"].query_selector("td.calls-b").inner_text() == "1 paid, 0 replayed"
        assert rows["/w0"].query_selector("td.calls-b").inner_text() == "0 paid, 1 replayed"
        assert "changed" in (rows["/w1"].get_attribute("class") or "")
        assert "lighthouse" in rows["/w1"].inner_text()
        assert "2 calls paid, 2 replayed" in page.inner_text("#totals")
        page.screenshot(path=str(ARTIFACTS / "diff.png"), full_page=True)
        assert errors == []
