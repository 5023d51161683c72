"""Running goals: ``submit``, ``run``, ``worker`` and ``agents``.

``submit`` and ``run`` take the same options (:class:`GoalOptions`, added to both by
:func:`with_goal_options`): the agent that receives the goal, its type and priority, the
tree's budgets, an extra payload, success and kill criteria, an idempotency key and the
modules to import agents from. ``run`` runs only the tree it submitted (a worker in this
process, :mod:`runtime.inprocess`, as ``orgchart.Client.run`` does), then prints the
root's answer; it exits 1 when the root ends failed or escalated (or is still running
after ``--timeout``). ``submit`` warns when no live worker would run the goal.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from runtime.cli.common import (
    EXIT_FAILED,
    JsonOpt,
    ModulesOpt,
    err,
    fail,
    install_stop_signals,
    open_runtime,
    out,
    print_json,
    settings,
)
from runtime.engine.gc_tuning import tune_gc
from runtime.store.rows import TERMINAL_STATUSES, NewTask
from runtime.telemetry.traces import stop_trace_export

if TYPE_CHECKING:
    from agents.registry import Registry
    from runtime.config import Settings

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class GoalOptions:
    """The options ``submit`` and ``run`` share (one field per command-line option)."""

    agent: str = "ceo"
    type_: str | None = None
    priority: int = NewTask.priority
    budget_tokens: int = NewTask.budget_tokens
    budget_seconds: int = NewTask.budget_seconds
    budget_usd: str = str(NewTask.budget_usd)
    payload: str | None = None
    success: str | None = None
    kill: str | None = None
    idempotency_key: str | None = None
    tenant: str = NewTask.tenant
    agents_module: list[str] | None = None

    def new_task(self, registry: Registry, config: Settings, goal: str) -> NewTask:
        """Validate these options and ``goal``; return the root task to insert.

        Raises:
            BadInput: an unknown agent, a bad payload, budget or criterion.

        """
        from runtime.wiring import build_root, parse_json_option

        return build_root(
            registry, config, goal=goal, agent=self.agent, type_=self.type_,
            priority=self.priority, budget_tokens=self.budget_tokens,
            budget_seconds=self.budget_seconds, budget_usd=self.budget_usd,
            payload=parse_json_option("--payload", self.payload),
            success=parse_json_option("--success", self.success),
            kill=parse_json_option("--kill", self.kill), idempotency_key=self.idempotency_key,
            tenant=self.tenant,
        )


#: The command-line form of each :class:`GoalOptions` field.
GOAL_OPTION_TYPES: dict[str, Any] = {
    "agent": Annotated[str, typer.Option("--agent", help="Agent that receives the goal.")],
    "type_": Annotated[str | None, typer.Option("--type", help="Task type (agent's default).")],
    "priority": Annotated[int, typer.Option("--priority", help="Lower is more urgent.")],
    "budget_tokens": Annotated[int, typer.Option("--budget-tokens",
                                                 help="Tree-wide token budget.")],
    "budget_seconds": Annotated[int, typer.Option("--budget-seconds", help="Seconds per run.")],
    "budget_usd": Annotated[str, typer.Option("--budget-usd", help="Tree-wide USD budget.")],
    "payload": Annotated[str | None, typer.Option("--payload", help="Extra payload (JSON).")],
    "success": Annotated[str | None, typer.Option("--success", help="success_criteria JSON.")],
    "kill": Annotated[str | None, typer.Option("--kill", help="kill_criteria JSON.")],
    "idempotency_key": Annotated[str | None, typer.Option("--idempotency-key",
                                                          help="Deduplicates submits.")],
    "tenant": Annotated[str, typer.Option(
        "--tenant", help="The tenant the tree runs under ([tenants.<name>] shares and limits).")],
    "agents_module": ModulesOpt,
}


def with_goal_options(fn: F) -> F:
    """Give a command every :class:`GoalOptions` option; it receives them as ``options``.

    ``fn(goal, options, **rest)`` becomes a command taking ``goal``, the goal options,
    then ``rest`` (its own options), as Typer reads signatures.
    """
    own = inspect.signature(fn, eval_str=True).parameters
    names = [f.name for f in fields(GoalOptions)]
    shared = [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                default=f.default, annotation=GOAL_OPTION_TYPES[f.name])
              for f in fields(GoalOptions)]
    params = [own["goal"], *shared,
              *(p for name, p in own.items() if name not in ("goal", "options"))]

    def command(*args: Any, **kwargs: Any) -> Any:
        bound = command.__signature__.bind(*args, **kwargs)  # type: ignore[attr-defined]
        bound.apply_defaults()
        values = dict(bound.arguments)
        options = GoalOptions(**{name: values.pop(name) for name in names})
        return fn(options=options, **values)

    command.__name__, command.__qualname__ = fn.__name__, fn.__qualname__
    command.__doc__, command.__module__ = fn.__doc__, fn.__module__
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command  # type: ignore[return-value]


@with_goal_options
def submit(goal: str, options: GoalOptions, json_: JsonOpt = False) -> None:
    """Submit a root goal; print its id (the root id)."""
    from runtime.views import task_json
    from runtime.wiring import load_registry, open_store, submit_root

    # Submitting needs the agents' schemas and the database, not the model backend.
    config = settings()
    registry = load_registry(config, options.agents_module or [])
    new = options.new_task(registry, config, goal)
    store = open_store(config)
    task, created = submit_root(store, new, "cli", config.database.failover_timeout_seconds)
    # A goal nobody will run is worth a word (a warning: a worker may start later).
    warning = store.claims.no_worker_warning(new.to_agent,
                                             config.worker.maintenance_interval_seconds)
    if json_:
        print_json({**task_json(task), "created": created,
                    **({"warning": warning} if warning else {})})
    else:
        out.print(str(task["id"]), highlight=False)
        if not created:
            err.print("[dim]idempotency key seen before: returned the existing task[/]")
        _say_if_held(task)
    if warning:
        err.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)


def _say_if_held(task: dict[str, Any]) -> None:
    """On stderr: the root waits for a person (``[policies] require_approval``), and how."""
    if task["status"] == "awaiting_approval":
        err.print(f"held for approval ([policies] require_approval lists {task['to_agent']}):"
                  f" orgchart approve {task['id']}  (or reject {task['id']} --note ...)",
                  markup=False, highlight=False, soft_wrap=True)


@with_goal_options
def run(goal: str, options: GoalOptions, json_: JsonOpt = False,
        timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 600,
        max_in_flight: Annotated[int | None, typer.Option(
            help="Most tasks held at once (default [worker] max_in_flight).")] = None,
        quiet: Annotated[bool, typer.Option(
            "--quiet", help="Print only the root's answer (for scripts): no live "
            "tree, no model text.")] = False,
        ) -> None:
    """Submit a goal, run its tree (only it) here, drawing it live; print the root's answer.

    The model calls' text is printed as it streams (on stderr off a terminal).
    """
    runtime = open_runtime(options.agents_module)
    from runtime.wiring import submit_root

    task, _ = submit_root(runtime.store,
                          options.new_task(runtime.registry, runtime.settings, goal), "cli",
                          runtime.settings.database.failover_timeout_seconds)
    _say_if_held(task)  # then it waits for the approval like any other step, up to timeout
    drain(runtime, task["id"], json_, timeout, max_in_flight, quiet=quiet)


def drain(runtime: Any, root_id: Any, json_: bool, timeout: float,
          max_in_flight: int | None, quiet: bool = False) -> None:
    """Run a worker in this process for the tree of ``root_id`` until it ends; print it.

    The worker claims that tree only (:func:`runtime.inprocess.run_tree`, what
    ``orgchart.Client.run`` runs too). The tree is drawn live on a terminal, with the
    model calls' text printed above it as it streams (on stderr when stdout is no
    terminal), then the root's answer is printed; ``quiet`` prints the answer only. The
    exit status is 1 when the root did not end ``done`` (or is still running after
    ``timeout`` seconds).
    """
    from runtime.cli.render import LiveText, render_tree
    from runtime.inprocess import run_tree
    from runtime.views import TreeFollower, critical_path_summary

    def started(worker: Any) -> None:
        install_stop_signals(worker.stop)
        tune_gc(runtime.settings.worker.gc_threshold)  # this process is the worker's

    current = TreeFollower(runtime.store, root_id).refresh  # reads what changed only
    if out.is_terminal and not json_ and not quiet:
        with Live(render_tree(current()), console=out, refresh_per_second=8) as live:

            def redraw() -> str:
                tree = current()
                live.update(render_tree(tree))
                return str(tree["status"])

            text = LiveText(runtime.store.streams, root_id, _printer_of(live.console),
                            whole_lines=True).start()
            status = run_tree(runtime, root_id, timeout=timeout,
                              max_in_flight=max_in_flight, started=started, tick=redraw)
            text.stop(status in TERMINAL_STATUSES)
        tree = current()
    else:
        printing = (None if json_ or quiet else
                    LiveText(runtime.store.streams, root_id, _printer_of(err)).start())
        status = run_tree(runtime, root_id, timeout=timeout, max_in_flight=max_in_flight,
                          started=started)
        if printing is not None:
            printing.stop(status in TERMINAL_STATUSES)
        tree = current()
        if not json_ and not quiet:
            out.print(render_tree(tree))
    if json_:
        print_json(tree)
    else:
        print_answer(tree)
    if not quiet:
        err.print(f"root {root_id} (orgchart tree {root_id})", style="dim", markup=False,
                  highlight=False)
        err.print(critical_path_summary(runtime.store, root_id), markup=False,
                  highlight=False, soft_wrap=True)
    if tree["status"] not in TERMINAL_STATUSES:
        fail(f"root {root_id} is still {tree['status']} after {timeout:g}s", EXIT_FAILED)
    if tree["status"] != "done":
        err.print(f"root {root_id} ended {tree['status']}: {tree.get('error') or ''}",
                  markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED)


def _printer_of(console: Console) -> Callable[[str], None]:
    """Write text to ``console`` as it is (no markup, no highlighting, no added newline)."""
    return lambda text: console.print(text, end="", markup=False, highlight=False,
                                      soft_wrap=True)


def print_answer(tree: dict[str, Any]) -> None:
    """Print the root's result on stdout, readable: its text fields, its lists as bullets."""
    result = tree.get("result")
    if result is None:
        return
    out.print(Text("answer", style="bold"))
    out.print(answer_text(result), markup=False, highlight=False, soft_wrap=True)


def answer_text(result: Any) -> str:
    """A result as a person reads it: ``key: text`` lines, lists as ``- item`` lines.

    Text fields come first (a summary before its findings), then lists, then the rest;
    a result that is not an object is shown as it is (text) or as JSON.
    """
    if isinstance(result, str):
        return result
    if not isinstance(result, dict):
        return json.dumps(result, indent=2, default=str)
    lines: list[str] = []
    order = sorted(result.items(), key=lambda kv: (not isinstance(kv[1], str),
                                                   not isinstance(kv[1], list)))
    for key, value in order:
        if isinstance(value, list):
            if value:
                lines.append(f"{key}:")
                lines += [f"  - {_one(item)}" for item in value]
        elif value is not None and value != "":
            lines.append(f"{key}: {_one(value)}")
    return "\n".join(lines)


def _one(value: Any) -> str:
    """One value on a line: text as it is, anything else as compact JSON."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def worker(
    agents: Annotated[str | None, typer.Option(
        help="Comma-separated agents to serve ('judge' = the judge stage); default all.")] = None,
    sync_threads: Annotated[int | None, typer.Option(
        help="Threads for sync agents (default [worker] sync_threads).")] = None,
    concurrency: Annotated[int | None, typer.Option(
        hidden=True, help="Retired: use --sync-threads.")] = None,
    max_in_flight: Annotated[int | None, typer.Option(
        help="Most tasks this process holds at once (default [worker] max_in_flight).")]
    = None,
    batch_size: Annotated[int | None, typer.Option(help="Most tasks per claim.")] = None,
    task_cap: Annotated[int | None, typer.Option(help="Exit after claiming N tasks.")] = None,
    wall_clock: Annotated[float | None, typer.Option(help="Exit after S seconds.")] = None,
    lease_seconds: Annotated[float | None, typer.Option(help="Lease length.")] = None,
    once: Annotated[bool, typer.Option(help="Exit when the queue is empty.")] = False,
    maintenance: Annotated[bool, typer.Option(
        "--maintenance/--no-maintenance",
        help="Run the reaper, watchdog and sweeper (and tick schedules) here.")] = True,
    worker_id: Annotated[str | None, typer.Option(
        help="Name written as lease_owner and in task_events (default host:pid:random).")]
    = None,
    agents_module: ModulesOpt = None, json_: JsonOpt = False,
) -> None:
    """Claim and run tasks until stopped (SIGTERM/SIGINT), a cap, or an empty queue."""
    if concurrency is not None:
        fail("--concurrency was retired: use --sync-threads (threads for sync agents)")
    runtime = open_runtime(agents_module)
    names = [a.strip() for a in agents.split(",") if a.strip()] if agents else None
    w = runtime.worker(names, sync_threads=sync_threads, max_in_flight=max_in_flight,
                       batch_size=batch_size,
                       task_cap=task_cap, wall_clock_seconds=wall_clock,
                       lease_seconds=lease_seconds, once=once,
                       maintenance=maintenance, worker_id=worker_id)
    install_stop_signals(w.stop)
    err.print(f"worker {w.config.worker_id} serving {', '.join(w.config.agents)}",
              style="dim", markup=False, highlight=False)
    tune_gc(runtime.settings.worker.gc_threshold)  # this process is the worker's
    from runtime.cli.schedules import start_ticker

    # Schedules tick beside the worker's maintenance (a disposable worker runs no fire).
    ticker = start_ticker(runtime.store, runtime.settings,
                          host_fires=not once) if maintenance else None
    try:
        stats = w.run()
    finally:
        if ticker is not None:
            ticker.stop()
    stop_trace_export()  # what ended goes out now, not from an exit hook
    if json_:
        print_json({"worker": w.config.worker_id, **stats.as_dict()})
    else:
        err.print(f"worker {w.config.worker_id} stopped ({stats.stop_reason}): claimed "
                  f"{stats.claimed}, outcomes {dict(stats.outcomes)}, delegated "
                  f"{stats.delegated}, stale {stats.stale}, handed back {stats.released}",
                  markup=False, highlight=False)


def agents(agents_module: ModulesOpt = None, json_: JsonOpt = False) -> None:
    """List registered agents: types, delegation targets, input and output schemas."""
    from agents.tools import described as described_tools
    from runtime.wiring import load_registry, mcp_tool_source

    registry = load_registry(settings(), agents_module or [])
    described = registry.describe()
    source = mcp_tool_source(settings(), registry)
    if source is not None:  # the MCP servers are started to list their tools, then stopped
        try:
            for a in described:
                a["tools"] += described_tools(source.tools_for(a["name"]))
        finally:
            source.close()
    if json_:
        print_json(described)
        return
    table = Table("agent", "types", "delegates to", "input fields", "output fields", "tools",
                  "module")
    for a in described:
        table.add_row(a["name"], ", ".join(a["types"]), ", ".join(a["delegates_to"]) or "-",
                      ", ".join(a["input_schema"].get("properties", {})),
                      ", ".join(a["output_schema"].get("properties", {})),
                      ", ".join(t["name"] for t in a["tools"]) or "-", a["module"])
    out.print(table)
