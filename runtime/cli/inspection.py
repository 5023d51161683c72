"""Inspecting trees and serving them: ``tree``, ``show``, ``escalations``, ``resolve``, ...

The commands: ``tree``, ``show``, ``escalations``, ``resolve``, ``metrics``, ``prune``,
``serve`` and ``mcp``. Each reads through :class:`runtime.store.store.Store` and prints either
rich text or, with ``--json``, the public shapes of :mod:`runtime.views` (shared with the
HTTP API, so the CLI and the API answer alike). A malformed id, a missing task or a
refused resolution exits 2 with a message naming the problem (the one error handler,
:func:`runtime.cli.common.handled`).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table

from runtime.cli.common import (
    EXIT_BAD_INPUT,
    JsonOpt,
    ModulesOpt,
    TaskRef,
    err,
    fail,
    opened_store,
    out,
    print_json,
    settings,
)
from runtime.cli.render import STATUS_STYLE, render_tree, served_text
from runtime.http.auth import API_TOKEN_ENV, api_token, is_loopback
from runtime.store.rows import TERMINAL_STATUSES
from runtime.views import (
    TreeFollower,
    critical_path_summary,
    escalation_json,
    task_detail_json,
    task_json,
)

#: How often ``tree --watch`` redraws.
WATCH_INTERVAL_SECONDS = 1.0


def _clock(iso: str | None) -> str:
    """``HH:MM:SS.mmm`` of an ISO timestamp (the history of one task spans one day, mostly)."""
    return iso[11:23] if iso else "-"


def _when(iso: str | None) -> str:
    """``YYYY-MM-DD HH:MM`` of an ISO timestamp."""
    return iso[:16].replace("T", " ") if iso else "-"


class _RedactTokens(logging.Filter):
    """Keep ``?token=...`` out of uvicorn's access log."""

    _TOKEN = re.compile(r"(token=)[^&\s]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self._TOKEN.sub(r"\1***", a) if isinstance(a, str) else a
                                for a in record.args)
        return True


# ---------------------------------------------------------------------- commands
def styled(status: str) -> str:
    """``status`` in its colour (rich markup)."""
    return f"[{STATUS_STYLE.get(status, '')}]{status}[/]"

def tree(
    root_id: Annotated[str, typer.Argument(help="The root task's id.")],
    json_: JsonOpt = False,
    watch: Annotated[bool, typer.Option(
        "--watch", help="Redraw every second until the root is finished "
                        "(with --json: wait, then print).")] = False,
    interval: Annotated[float, typer.Option(
        help="Seconds between redraws with --watch.", min=0.1)] = WATCH_INTERVAL_SECONDS,
) -> None:
    """Draw a task tree: statuses, agents, spend, durations, verdicts, errors."""
    ref = TaskRef.parse(root_id, "root id")
    with opened_store() as store:
        rid = ref.resolve(store)
        follow = TreeFollower(store, rid).refresh  # --watch reads what changed only
        current = follow()
        if watch and not json_ and out.is_terminal:
            try:
                with Live(render_tree(current), console=out, refresh_per_second=4) as live:
                    while current["status"] not in TERMINAL_STATUSES:
                        time.sleep(interval)
                        current = follow()
                        live.update(render_tree(current))
            except KeyboardInterrupt:
                return
            return
        while watch and current["status"] not in TERMINAL_STATUSES:
            time.sleep(interval)
            current = follow()
        summary = None if json_ else critical_path_summary(store, rid)
        pause = store.steering.pause_of(rid)
    if json_:
        # A paused tree says so on its root (fields may be added to the shape).
        print_json({**current, "paused": True} if pause is not None else current)
    else:
        if pause is not None:
            out.print(f"[bold yellow]paused[/] since {pause['paused_at']:%Y-%m-%d %H:%M:%S} "
                      f"by {escape(str(pause['paused_by']))}: orgchart resume {rid}")
        out.print(render_tree(current))
        out.print(summary, style="dim", markup=False, highlight=False, soft_wrap=True)

def show(task_id: Annotated[str, typer.Argument(help="The task's id.")],
         json_: JsonOpt = False) -> None:
    """One task: its fields, result, history of transitions, children and model calls."""
    ref = TaskRef.parse(task_id)
    with opened_store() as store:
        detail = task_detail_json(store, ref.resolve(store))
    if json_:
        print_json(detail)
        return
    _print_detail(detail)

def _detail_fields(d: dict[str, Any]) -> Table:
    """The task's own fields, one per line."""
    import json

    fields = Table.grid(padding=(0, 2))
    fields.add_column(style="bold")
    fields.add_column()
    verdict = d.get("verdict")
    rows: list[tuple[str, str]] = [
        ("id", d["id"]), ("status", styled(d["status"])),
        ("agent", f"{escape(d['agent'])} ({escape(d['type'])})"),
        ("root", d["root_id"]), ("parent", d["parent_id"] or "-"),
        ("priority", str(d["priority"])), ("tenant", escape(str(d.get("tenant", "default")))),
        ("spend", f"{d['spent_tokens']} tokens, ${d['spent_usd']} "
                  f"(own: {d['own_tokens']} tokens, ${d['own_usd']})"),
        ("budget", f"{d['budget_tokens']} tokens, {d['budget_seconds']} s, "
                   f"${d['budget_usd']}"),
        ("duration", f"{d['duration_seconds']:.3f} s"),
        ("route", escape(f"{d['route']}:{d['model']}") if d.get("route") else "-"),
        ("served by", escape(served_text(d)) or "-"),
        ("deliveries", f"{d['delivery_count']} (retries {d['retry_count']})"),
        ("created", str(d["created_at"])), ("started", str(d["started_at"] or "-")),
        ("completed", str(d["completed_at"] or "-")),
        ("version", escape(str(d.get("agent_version") or "-"))),
        ("prompts", escape(", ".join(f"{name} {digest}" for name, digest
                                     in sorted((d.get("prompt_hashes") or {}).items())))
         or "-"),
    ]
    if d.get("forked_from"):
        rows.append(("forked from", str(d["forked_from"])))
    if verdict:
        rows.append(("verdict", escape(json.dumps(verdict, default=str))))
    if d.get("error"):
        rows.append(("error", f"[red]{escape(str(d['error']))}[/]"))
    for name, value in rows:
        fields.add_row(name, value)
    return fields


def _model_calls_table(model_calls: list[dict[str, Any]]) -> Table:
    """One line per model call: its kind (replayed, a retry, with thinking), route, spend."""
    calls = Table("#", "kind", "backend", "route", "model", "tokens", "cost", "seconds",
                  "error", title="model calls")
    for c in model_calls:
        kind = "replayed" if c.get("replayed") else str(c.get("attempt_kind") or "call")
        if int(c.get("call_try") or 1) > 1:
            kind += f" #{c['call_try']}"
        if c.get("thinking_present"):
            kind += " +thinking"
        calls.add_row(f"{c['attempt']}.{c['call_index']}", escape(kind),
                      escape(str(c["backend"])),
                      escape(str(c["route"])), escape(str(c["model"])),
                      f"{c['prompt_tokens']}+{c['completion_tokens']}",
                      f"${c['cost_usd']}", f"{float(c['duration_seconds'] or 0):.3f}",
                      escape(str(c["error"] or "")))
    return calls


def _print_detail(d: dict[str, Any]) -> None:
    import json

    out.print(_detail_fields(d))
    out.print("[bold]payload[/]", escape(json.dumps(d["payload"], indent=2)))
    if d.get("result") is not None:
        out.print("[bold]result[/]", escape(json.dumps(d["result"], indent=2)))
    events = Table.grid(padding=(0, 2))
    events.add_column(no_wrap=True, style="dim")
    events.add_column(no_wrap=True)
    events.add_column(style="dim", max_width=28)
    events.add_column(ratio=1)
    for e in d["events"]:
        events.add_row(_clock(e["at"]), (e["from_status"] or "") + " -> "
                       + styled(e["to_status"]), escape(e["worker"] or "-"),
                       escape(e["detail"] or ""))
    out.print("[bold]history[/] (UTC)")
    out.print(events)
    if d["children"]:
        kids = Table("id", "agent", "status", title=f"children ({len(d['children'])})")
        for c in d["children"]:
            kids.add_row(c["id"], escape(c["agent"]), styled(c["status"]))
        out.print(kids)
    if d["model_calls"]:
        out.print(_model_calls_table(d["model_calls"]))
    if d.get("steps"):
        out.print(_steps_table(d["steps"]))
    if d.get("tool_approvals"):
        out.print(_approvals_table(d["tool_approvals"]))


def _steps_table(steps: list[dict[str, Any]]) -> Table:
    """One line per durable step or tool call: arguments, result or error, replayed."""
    table = Table("id", "kind", "name", "args", "result / error", "seconds", "runs",
                  title="steps and tool calls")
    for s in steps:
        outcome = (f"[red]{escape(str(s['error']))}[/]" if s["error"]
                   else escape(str(s["result"] if s["result"] is not None else "-")))
        runs = f"started {s['starts']}x" + (f", replayed {s['replays']}x" if s["replays"]
                                             else "")
        if s["status"] == "started":
            runs += ", unfinished"
        table.add_row(escape(str(s["tool_call_id"] or s["position"])), escape(s["kind"]),
                      escape(s["name"]), escape(str(s["args"] or "")), outcome,
                      f"{float(s['duration_seconds'] or 0):.3f}", runs)
    return table

def _approvals_table(asks: list[dict[str, Any]]) -> Table:
    """One line per tool call that asked for a person: the tool, its arguments, the decision."""
    table = Table("call", "tool", "args", "decision", "by", "note", title="tool approvals")
    for a in asks:
        table.add_row(escape(str(a["call_id"])), escape(str(a["tool"])),
                      escape(str(a["args"] or "")), escape(str(a["status"])),
                      escape(str(a["decided_by"] or "-")), escape(str(a["note"] or "")))
    return table


def escalations(json_: JsonOpt = False) -> None:
    """The tasks waiting for a person, oldest first, with the rule that stopped them."""
    with opened_store() as store:
        items = [escalation_json(r) for r in store.reads.escalations()]
    if json_:
        print_json(items)
        return
    if not items:
        out.print("no escalations")
        return
    out.print(f"[bold]{len(items)} escalated[/], oldest first")
    for e in items:
        block = Table.grid(padding=(0, 2))
        block.add_column(style="bold", no_wrap=True)
        block.add_column(ratio=1)
        block.add_row("rule", escape(e["rule"] or "-"))
        block.add_row("error", f"[red]{escape(e['error'] or '-')}[/]")
        block.add_row("root", f"{e['root_id'][:8]}  {escape(e['root_goal'] or '')}")
        out.print(f"\n[bold yellow]{e['id']}[/]  {escape(e['agent'])} ({escape(e['type'])})"
                  f"  since {_when(e['escalated_at'] or e['completed_at'])} UTC")
        out.print(Padding(block, (0, 0, 0, 2)))
    err.print("[dim]resolve with: orgchart resolve TASK_ID --retry | --done | --fail | "
              "--reassign AGENT [--note TEXT][/]")

def resolve(
    task_id: Annotated[str, typer.Argument(help="The escalated task's id.")],
    retry: Annotated[bool, typer.Option("--retry", help="Send it back to pending.")] = False,
    done: Annotated[bool, typer.Option("--done", help="Accept it as done.")] = False,
    fail_: Annotated[bool, typer.Option("--fail", help="Mark it failed.")] = False,
    reassign: Annotated[str | None, typer.Option(
        "--reassign", metavar="AGENT", help="Retry it with another agent.")] = None,
    note: Annotated[str | None, typer.Option(help="Why (kept in the history).")] = None,
    agents_module: ModulesOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Resolve an escalated task: exactly one of --retry, --done, --fail, --reassign."""
    chosen = [name for name, on in (("retry", retry), ("done", done), ("fail", fail_),
                                    ("reassign", reassign is not None)) if on]
    if len(chosen) != 1:
        fail("give exactly one of --retry, --done, --fail, --reassign AGENT"
             + (f" (got {', '.join('--' + c for c in chosen)})" if chosen else ""),
             EXIT_BAD_INPUT)
    ref = TaskRef.parse(task_id)
    if reassign is not None:
        from runtime.wiring import load_registry

        load_registry(settings(), agents_module or []).get(reassign)  # unknown: exit 2
    with opened_store() as store:
        tid = ref.resolve(store)
        before = store.reads.get(tid)["status"]
        task = store.transitions.resolve(tid, chosen[0], actor="cli", note=note,
                                         reassign_to=reassign)
    if json_:
        print_json(task_json(task))
        return
    out.print(f"task {tid}: {styled(before)} -> {styled(task['status'])} ({chosen[0]}"
              + (f" to {escape(reassign)}" if reassign else "") + ")")

def metrics(json_: JsonOpt = False) -> None:
    """Tasks by status, average retries, reclaimed work, mean duration, cost by route."""
    with opened_store() as store:
        m = store.reads.metrics()
    if json_:
        print_json(m)
        return
    table = Table("status", "tasks", title="tasks by status")
    for status, n in sorted(m["by_status"].items()):
        table.add_row(styled(status), str(n))
    out.print(table)
    out.print(f"average retries       {m['avg_retry']:.3f}")
    out.print(f"reclaimed (reaped)    {m['reclaimed_count']}")
    out.print(f"average duration      {m['avg_duration_seconds']:.3f} s")
    if not m["cost_by_route"]:
        out.print("spend by route        no model calls yet")
        return
    routes = Table("route", "tokens", "cost (USD)", title="spend by route")
    for route, cost in sorted(m["cost_by_route"].items()):
        routes.add_row(escape(str(route)), str(m.get("tokens_by_route", {}).get(route, "")),
                       cost)
    out.print(routes)
    backends = Table("served by", "calls", "tokens", "cost (USD)", "of it estimated",
                     title="spend by backend (estimated: the price of a model that did not "
                           "run; budgets count it)")
    for backend, row in sorted(m.get("cost_by_backend", {}).items()):
        backends.add_row(escape(backend), str(row["calls"]), str(row["tokens"]),
                         row["cost_usd"], row["estimated_usd"])
    out.print(backends)

def prune(
    older_than: Annotated[str, typer.Option(
        "--older-than", help="Age of the finished trees to delete: 30m, 12h, 7d, 2w.")],
    json_: JsonOpt = False,
) -> None:
    """Delete whole finished trees whose root completed longer ago than --older-than."""
    from runtime.wiring import parse_duration

    age = parse_duration(older_than)
    with opened_store() as store:
        trees, tasks = store.reads.prune(age)
    if json_:
        print_json({"trees": trees, "tasks": tasks, "older_than_seconds":
                    age.total_seconds()})
        return
    out.print(f"removed {trees} trees ({tasks} tasks) finished more than {older_than} ago")

def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", min=0, max=65535)] = 8000,
    agents_module: ModulesOpt = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve the HTTP API and the live tree page (FastAPI on uvicorn)."""
    import uvicorn

    from runtime.http.api import create_app
    from runtime.wiring import load_registry

    token = api_token()
    if not is_loopback(host) and token is None:
        fail(f"refusing to listen on {host} without {API_TOKEN_ENV}: anyone who can reach "
             f"it could submit and resolve tasks. Set {API_TOKEN_ENV} (clients then send "
             "'Authorization: Bearer <token>') or listen on 127.0.0.1", EXIT_BAD_INPUT)
    cfg = settings()
    api = create_app(settings=cfg, registry=load_registry(cfg, agents_module or []))
    from runtime.webhooks import start_delivery

    start_delivery(api.state.store, cfg)  # serve delivers the webhook outbox too
    from runtime.mcp.mount import mount
    from runtime.mcp.server import build_server

    mount(api, build_server(api.state.store, cfg, api.state.registry), is_loopback(host))
    logging.getLogger("uvicorn.access").addFilter(_RedactTokens())
    from runtime.store.postgres import failover

    failover.OUTAGE.level = logging.WARNING  # a failover is logged once, and its end
    from runtime.cli.schedules import start_ticker
    from runtime.wiring import open_store

    start_ticker(open_store(cfg), cfg, host_fires=True)  # schedules tick while it serves
    where = f"[{host}]" if ":" in host else host
    err.print(f"[dim]serving on http://{where}:{port}/ (API docs at /docs, MCP at /mcp"
              + ("; bearer token required" if token else "") + ")[/]", highlight=False)
    uvicorn.run(api, host=host, port=port, log_level=log_level.lower())


def mcp(agents_module: ModulesOpt = None,
        worker: Annotated[bool, typer.Option(
            "--worker", help="Also run a worker in this process (a single-machine host: "
            "no other process needed for goals to run).")] = False) -> None:
    """Serve the Model Context Protocol on stdin/stdout (Claude Desktop, Cursor, ...).

    The tools and resources are those of ``/mcp`` on ``orgchart serve`` (docs/mcp.md);
    nothing but the protocol is written to stdout.
    """
    from runtime.mcp.server import serve_stdio

    serve_stdio(settings(), agents_module or [], worker=worker)
