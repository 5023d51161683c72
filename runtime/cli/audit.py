"""``orgchart audit``: check the database (and a client history) against the promises.

Reads only (:func:`runtime.audit.checker.audit`: read-only transactions, bounded batches),
so it is safe on a production database. Prints each violation with the events, calls and
client operations that show it (``--json``: the report's JSON), then what it checked.
Exit status: 0 when no promise was broken, 1 when one was, 2 on bad input (a malformed
id, time or history file).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated

import typer

from runtime.audit.checker import SLACK_SECONDS, audit
from runtime.audit.history import load
from runtime.cli.common import EXIT_FAILED, JsonOpt, TaskRef, opened_store, out, print_json
from runtime.errors import BadInput


def _since(text: str | None) -> dt.datetime | None:
    if text is None:
        return None
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise BadInput(f"--since {text!r} is not an ISO time (2026-12-06T03:00:00Z)") from None
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def audit_command(
    root: Annotated[list[str] | None, typer.Option(
        "--root", help="Only this tree (its root id); repeatable.")] = None,
    since: Annotated[str | None, typer.Option(
        "--since", help="Only trees submitted at or after this ISO time.")] = None,
    history: Annotated[Path | None, typer.Option(
        "--history", help="A client history (JSON lines) to check too.")] = None,
    slack: Annotated[float, typer.Option(
        "--slack", help="Seconds allowed between clocks.")] = SLACK_SECONDS,
    json_: JsonOpt = False,
) -> None:
    """Check what the database holds (and what clients were told) against the promises."""
    refs = [TaskRef.parse(r, "root id") for r in root] if root else None
    when = _since(since)
    if history is not None:
        try:
            parsed = load(history)
        except (OSError, ValueError) as exc:
            raise BadInput(f"--history: {exc}") from None
    with opened_store() as store:
        roots = [r.resolve(store) for r in refs] if refs is not None else None
        report = audit(store, roots, when, parsed if history is not None else None, slack)
    if json_:
        print_json(report.as_json())
    else:
        out.print(report.text(), highlight=False, markup=False, soft_wrap=True)
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)
