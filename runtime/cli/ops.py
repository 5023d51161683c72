"""Operating orgchart: ``fire`` (one fire of the decider), ``doctor``, ``db upgrade``, ``db url``.

``fire`` takes the fire lock, respects the daily cap, runs hygiene, plans, fans out
disposable workers and prints the rollup note (``--json``: the whole
:class:`runtime.fleet.orchestrator.FireResult`). A fire that cannot run (another holds the
lock, the daily cap is reached) says so and exits 0: that is the system working.
``--dry-run`` prints the plan and touches nothing.

``doctor`` exits 1 with one line per problem when the last fire is overdue, work is
stranded, or an escalation has waited too long; 0 with a short all-clear otherwise.
Schedule ``fire`` and alert on ``doctor`` (see ``docs/operations.md``).

``db upgrade`` runs the migrations (they also run on first use); ``db url`` prints the
database URL orgchart uses, password hidden.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from runtime.cli.common import (
    EXIT_FAILED,
    JsonOpt,
    err,
    install_stop_signals,
    opened_store,
    out,
    print_json,
    settings,
)
from runtime.store.postgres.migrations import upgrade
from runtime.store.postgres.urls import redacted, settled_url


def _settings_and_store() -> tuple[Any, Any]:
    from runtime.wiring import open_store

    s = settings()
    return s, open_store(s)


def fire(
    max_workers: Annotated[int | None, typer.Option(
        help="Workers running at once (default [orchestrator] max_workers).")] = None,
    task_cap: Annotated[int | None, typer.Option(
        help="Tasks each worker may claim (default [orchestrator] task_cap).")] = None,
    wall_clock: Annotated[float | None, typer.Option(
        help="Seconds for the fire and each worker (default [orchestrator] "
             "wall_clock_seconds).")] = None,
    dry_run: Annotated[bool, typer.Option(
        help="Print the plan; run no hygiene, no workers, write nothing.")] = False,
    agents_module: Annotated[list[str] | None, typer.Option(
        "--agents-module", help="Import agents and policy rules from this module (passed "
                                "to the workers: its rules are on); repeatable.")] = None,
    json_: JsonOpt = False,
) -> None:
    """One fire: lock, daily cap, hygiene, plan, fan out capped workers, print the rollup."""
    from runtime.fleet.orchestrator import FireConfig, Orchestrator

    s, store = _settings_and_store()
    config = FireConfig.from_settings(s, max_workers=max_workers, task_cap=task_cap,
                                      wall_clock_seconds=wall_clock,
                                      agents_modules=tuple(agents_module or ()))
    orchestrator = Orchestrator(store, s, config)
    orchestrator.known_modes()  # a bad --agents-module fails here, before anything runs
    if dry_run:
        result = orchestrator.plan_only()
    else:
        install_stop_signals(orchestrator.stop)
        from runtime.cli.schedules import start_ticker

        ticker = start_ticker(store, s, host_fires=False)  # goal schedules tick here too
        try:
            result = orchestrator.run_once()
        finally:
            ticker.stop()
    if json_:
        print_json(result.as_dict())
    elif result.status in ("locked", "capped"):
        out.print(result.message, highlight=False, markup=False)
    else:
        out.print(result.rollup, highlight=False, markup=False, soft_wrap=True)
        if result.status == "dry_run":
            err.print(result.message, style="dim", highlight=False, markup=False)


def doctor(json_: JsonOpt = False) -> None:
    """Exit 1 naming each problem (overdue fire, stranded work, old escalations); else 0.

    Notes (no fire has ever run: fine with always-on workers) are printed, never failed on.
    """
    from runtime.fleet.doctor import DoctorLimits, check

    s = settings()
    with opened_store(s) as store:  # a checkup says at once when the database is down
        checkup = check(store, DoctorLimits.from_settings(s.orchestrator, s.doctor, s.webhooks))
    if json_:
        print_json(checkup.as_dict())
    else:
        for note in checkup.notes:  # information: not a reason to exit 1
            out.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
        if checkup.ok:
            out.print(checkup.summary(), highlight=False, markup=False)
        for problem in checkup.problems:
            out.print(f"problem: {problem}", highlight=False, markup=False, soft_wrap=True)
    if not checkup.ok:
        raise typer.Exit(EXIT_FAILED)


def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Run the migrations (they also run automatically on first use)."""
    url = settled_url(settings().database.url)
    upgrade(url, revision)
    out.print(f"database at {redacted(url)} is at {revision}", highlight=False)


def db_url() -> None:
    """Print the database URL orgchart uses (password hidden)."""
    out.print(redacted(settled_url(settings().database.url)), highlight=False)
