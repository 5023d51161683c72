"""Schedules: ``schedule add|list|runs|pause|resume|remove|run-now``, and the tick's start.

``schedule add NAME (--cron LINE [--timezone TZ] | --every 30s) (--goal TEXT [--agent A
--payload JSON --tenant T ...] | --fire) [--overlap skip|allow|cancel_previous]
[--catchup-window 1h]`` stores a schedule; bad input (a bad cron line or interval, an
unknown time zone or agent) exits 2 and stores nothing. ``run-now`` fires an extra
slot: a goal's root is inserted, a fire runs here in the foreground like ``orgchart
fire``. The slots themselves are fired by every worker, ``serve`` and ``fire`` process
(:func:`start_ticker`), exactly once across them.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from runtime.cli.common import JsonOpt, ModulesOpt, opened_store, out, print_json, settings
from runtime.config import Settings
from runtime.errors import BadInput
from runtime.schedules.commands import (
    add_schedule,
    pause_schedule,
    resume_schedule,
    run_json,
    run_now,
    schedule_json,
)
from runtime.schedules.ticker import Ticker, TickerConfig
from runtime.store.store import Store

NameArg = Annotated[str, typer.Argument(help="The schedule's name.")]


def add(
    name: NameArg,
    cron: Annotated[str | None, typer.Option(help="A cron line: '0 7 * * *'.")] = None,
    timezone: Annotated[str | None, typer.Option(
        help="The cron line's time zone (IANA, e.g. Europe/Berlin; default UTC).")] = None,
    every: Annotated[str | None, typer.Option(help="An interval: 30s, 5m, 1h.")] = None,
    goal: Annotated[str | None, typer.Option(help="The goal of the root each slot starts.")]
    = None,
    fire: Annotated[bool, typer.Option("--fire", help="Each slot runs the orchestrator's "
                                                      "fire.")] = False,
    agent: Annotated[str, typer.Option(help="Agent that receives the goal.")] = "ceo",
    payload: Annotated[str | None, typer.Option(help="Extra payload (JSON).")] = None,
    tenant: Annotated[str, typer.Option(help="The tenant the trees run under.")] = "default",
    priority: Annotated[int, typer.Option(help="Lower is more urgent.")] = 5,
    budget_tokens: Annotated[int | None, typer.Option(help="Tree-wide token budget.")] = None,
    budget_seconds: Annotated[int | None, typer.Option(help="Seconds per run.")] = None,
    budget_usd: Annotated[str | None, typer.Option(help="Tree-wide USD budget.")] = None,
    success: Annotated[str | None, typer.Option(help="success_criteria JSON.")] = None,
    kill: Annotated[str | None, typer.Option(help="kill_criteria JSON.")] = None,
    overlap: Annotated[str, typer.Option(
        help="skip (no new root while the last is open), allow, or cancel_previous.")]
    = "skip",
    catchup_window: Annotated[str | None, typer.Option(
        help="Slots missed while nothing ran fire if at most this old (default 1m).")] = None,
    agents_module: ModulesOpt = None, json_: JsonOpt = False,
) -> None:
    """Store a schedule: a recurring root goal, or the orchestrator's fire."""
    if (goal is None) == (not fire):
        raise BadInput("give exactly one of --goal TEXT and --fire")
    config = settings()
    task = None
    if goal is not None:
        from runtime.wiring import build_root, load_registry, parse_json_option

        budgets: dict[str, Any] = {k: v for k, v in (("budget_tokens", budget_tokens),
                                                     ("budget_seconds", budget_seconds),
                                                     ("budget_usd", budget_usd))
                                   if v is not None}
        task = build_root(load_registry(config, agents_module or []), config, goal=goal,
                          agent=agent, priority=priority, tenant=tenant,
                          payload=parse_json_option("--payload", payload),
                          success=parse_json_option("--success", success),
                          kill=parse_json_option("--kill", kill), **budgets)
    with opened_store(config) as store:
        row = add_schedule(store, name=name, cron=cron, every=every, timezone=timezone,
                           task=task, overlap=overlap, catchup_window=catchup_window)
    if json_:
        print_json(row)
    else:
        out.print(f"schedule {escape(name)} stored: {escape(row['cadence'])}, next slot "
                  f"{row['next_at']}", highlight=False)


def list_(json_: JsonOpt = False) -> None:
    """Every schedule: its cadence, next slot, last fired slot and counts."""
    with opened_store() as store:
        rows = [schedule_json(r) for r in store.schedules.all()]
    if json_:
        print_json(rows)
        return
    if not rows:
        out.print("no schedules")
        return
    table = Table("name", "what", "cadence", "next slot", "last fired", "fired/skipped/missed",
                  "overlap", box=None, highlight=False)
    for r in rows:
        what = "fire" if r["kind"] == "fire" else f"{r['agent']}: {r['goal'] or ''}"[:40]
        table.add_row(escape(r["name"]) + (" (paused)" if r["paused"] else ""), escape(what),
                      escape(r["cadence"]), r["next_at"] or "", r.get("last_fired_at") or "-",
                      f"{r['fired']}/{r['skipped']}/{r['missed']}", r["overlap"])
    out.print(table)


def runs(name: NameArg, limit: Annotated[int, typer.Option(help="Most slots shown.")] = 20,
         json_: JsonOpt = False) -> None:
    """A schedule's recorded slots, newest first: fired (with the root), skipped, missed."""
    with opened_store() as store:
        rows = [run_json(r) for r in store.schedules.runs(name, limit)]
    if json_:
        print_json(rows)
        return
    for r in rows:
        started = r["root_id"] or (f"fire {r['fire_id']}" if r["fire_id"] else "")
        out.print(f"{r['slot_at']}  {r['state']:<7}  {started}  {escape(r['detail'] or '')}",
                  highlight=False)


def pause(name: NameArg, json_: JsonOpt = False) -> None:
    """Pause a schedule: it fires nothing until resumed."""
    with opened_store() as store:
        row = pause_schedule(store, name)
    _said(row, f"schedule {name} paused", json_)


def resume(name: NameArg, json_: JsonOpt = False) -> None:
    """Resume a schedule from its first slot after now."""
    with opened_store() as store:
        row = resume_schedule(store, name)
    _said(row, f"schedule {name} resumed; next slot {row['next_at']}", json_)


def remove(name: NameArg, json_: JsonOpt = False) -> None:
    """Remove a schedule and its recorded slots (the roots it started stay)."""
    with opened_store() as store:
        store.schedules.remove(name)
    _said({"name": name, "removed": True}, f"schedule {name} removed", json_)


def run_now_(name: NameArg, json_: JsonOpt = False) -> None:
    """Fire an extra slot now (the overlap policy holds); a fire runs here, in the foreground."""
    config = settings()
    with opened_store(config) as store:
        done = run_now(store, config, name)
        for fire_id in done.fires:
            result = _orchestrator(store, config).run_once(fire_id=fire_id)
            if not json_:
                out.print(result.rollup or result.message, highlight=False, markup=False)
    if json_:
        print_json(done.as_dict())
    elif done.roots:
        out.print(f"schedule {name}: root {done.roots[0]} started", highlight=False)
    elif done.skipped:
        out.print(f"schedule {name}: slot skipped, its last root is still open (overlap "
                  "skip)", style="yellow", highlight=False)


def _said(row: dict[str, Any], message: str, json_: bool) -> None:
    if json_:
        print_json(row)
    else:
        out.print(escape(message), highlight=False)


# ---------------------------------------------------------------------- the tick
def _orchestrator(store: Store, config: Settings) -> Any:
    from runtime.fleet.orchestrator import FireConfig, Orchestrator

    return Orchestrator(store, config, FireConfig.from_settings(config))


def start_ticker(store: Store, config: Settings, host_fires: bool) -> Ticker:
    """Start this process's schedule tick in a daemon thread; return it (``stop()`` it).

    ``host_fires``: a long-running process (``worker`` without ``--once``, ``serve``)
    runs the fires its fire schedules' slots start, each in a thread of its own; a
    disposable one leaves fire schedules to those.
    """
    worker = f"{socket.gethostname()}:{os.getpid()}:schedules"

    def start_fire(fire_id: int) -> None:
        threading.Thread(target=_orchestrator(store, config).run_once,
                         kwargs={"fire_id": fire_id}, name=f"fire-{fire_id}",
                         daemon=True).start()

    ticker = Ticker(store, TickerConfig.from_settings(config, worker),
                    start_fire if host_fires else None)
    ticker.start()
    return ticker
