"""The HTTP face of experiments (docs/experiments.md).

- ``GET /experiments``: every experiment, newest first.
- ``GET /experiments/{key}``: one experiment's report, by name or id (``orgchart
  experiment show --json``'s shape); 404 when there is none.
- ``GET /ui/experiments/{key}``: the same as a page: the variants' table, each scorer's
  mean against the cost paid (a chart), the regressions with their diffs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from runtime.experiments.report import load_report
from runtime.store.store import Store

_ERRORS: dict[int | str, dict[str, Any]] = {404: {"description": "no such experiment"}}


def add_experiment_routes(app: FastAPI, store: Store,
                          page: Callable[..., HTMLResponse]) -> None:
    """Add the experiment endpoints and the experiment page (rendered by ``page``)."""

    @app.get("/experiments", tags=["experiments"])
    def list_experiments() -> list[dict[str, Any]]:
        """Every experiment, newest first: name, status, dataset, trees."""
        return [{"id": str(r["id"]), "name": r["name"], "status": r["status"],
                 "dataset": r["dataset_name"], "version": r["dataset_version"],
                 "trees": r["trees"], "created_at": r["created_at"].isoformat()}
                for r in store.experiments.all()]

    @app.get("/experiments/{key}", tags=["experiments"], responses=_ERRORS)
    def get_experiment(key: str) -> dict[str, Any]:
        """An experiment's report (``orgchart experiment show --json``).

        Per variant its scores with intervals, cost paid and replayed, the difference
        from the baseline; the cases that regressed.
        """
        return load_report(store, key)

    @app.get("/ui/experiments/{key}", include_in_schema=False)
    def experiment_page(key: str, request: Request) -> HTMLResponse:
        load_report(store, key)  # 404 for an unknown experiment, before the page
        return page("experiment.html", request, key=key)
