"""The experiment page in a real headless Chromium: its table, its chart, a regression's diff.

The worked example of docs/experiments.md runs on the offline backend first; the page
then reads its report (``GET /experiments/{name}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.wiring import Runtime
from tests.integration.test_browser import (
    ARTIFACTS,
    CHROMIUM,
    TIMEOUT_MS,
    browser,  # noqa: F401  (the fixture)
    serve,
)
from tests.integration.test_experiments import (
    example_plan,
    runtime,  # noqa: F401  (the fixture)
)

pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason=f"{CHROMIUM} is missing (apt-get install -y chromium)"),
]


def test_the_experiment_page_shows_the_table_the_chart_and_a_regressions_diff(
        browser: Any, runtime: Runtime) -> None:  # noqa: F811  (the fixtures)
    from runtime.experiments.runner import ExperimentRunner

    ExperimentRunner(runtime).run(example_plan(runtime, "page"))
    ARTIFACTS.mkdir(exist_ok=True)
    with serve(runtime) as server:
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{server.url}/ui/experiments/page", timeout=TIMEOUT_MS)
        page.wait_for_selector("body[data-loaded='true']", timeout=TIMEOUT_MS)
        variants = page.locator("#variants tbody tr")
        assert variants.count() == 2
        assert page.locator("#variants tr[data-variant='sharper_trends'] td").nth(4) \
            .inner_text() != "0"  # the variant replayed calls
        assert page.locator("#scores tbody tr[data-scorer='done']").count() == 1
        assert "same" in page.locator(
            "#scores tr[data-scorer='done'] td[data-scorer='done']").nth(1).inner_text()
        assert page.locator("#chart circle.point").count() == 2
        assert page.locator("#chart circle.point-paid").count() == 2
        page.select_option("#chart-scorer", "tokens")
        assert page.locator("#chart text").filter(has_text="tokens").count() == 1
        page.screenshot(path=str(Path(ARTIFACTS) / "experiment.png"), full_page=True)
        changed = page.locator("#cases tbody tr")
        assert changed.count() > 0
        link = page.locator("#cases tbody tr a").first
        link.click()
        page.wait_for_selector("body[data-page='diff'][data-loaded='true']",
                               timeout=TIMEOUT_MS)
        assert page.locator("#diff tbody tr").count() > 0
        missing = page.goto(f"{server.url}/ui/experiments/nothing-here", timeout=TIMEOUT_MS)
        assert missing is not None and missing.status == 404
        assert errors == []
