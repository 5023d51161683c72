"""The ``orgchart`` command line.

Core commands live here (``run``, ``submit``, ``worker``, ``agents``, ``db``); the rest
register themselves from small modules (``cli_inspect``, ``cli_ops``, ``cli_policies``,
``cli_llm``). Exit status: 0 on success, 1 when a run's root ended failed or escalated
(or the runtime failed), 2 on bad input. Every listing has ``--json``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from agents.registry import DuplicateAgent, UnknownAgent
from runtime.config import ConfigError, Settings, load_settings
from runtime.errors import BadInput
from runtime.store.db import DatabaseUnavailable, redacted, resolve_url, upgrade
from runtime.store.models import TERMINAL_STATUSES
from runtime.store.rows import IdempotencyConflict, NotFound, ResolveRefused

app = typer.Typer(
    name="orgchart",
    help="A durable runtime for hierarchical multi-agent systems on PostgreSQL.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="Database commands.", no_args_is_help=True)
app.add_typer(db_app, name="db")

out = Console()
err = Console(stderr=True)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
COMMAND_MODULES = ("runtime.cli.inspection", "runtime.cli.ops", "runtime.cli.policies",
                   "runtime.cli.models")

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code``."""
    err.print(Text.assemble(("error: ", "bold red"), message), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def settings() -> Settings:
    """Load the configuration (``--config`` was turned into ``ORGCHART_CONFIG``)."""
    try:
        return load_settings()
    except ConfigError as exc:
        fail(str(exc))


def print_json(value: Any) -> None:
    """Print JSON on stdout (no colour, stable key order)."""
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")
    sys.stdout.flush()


def guarded(fn: F) -> F:
    """Turn known errors into clear messages and exit codes (no tracebacks)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (BadInput, UnknownAgent, IdempotencyConflict, ResolveRefused, ConfigError,
                DuplicateAgent) as exc:
            fail(str(exc), EXIT_BAD_INPUT)
        except NotFound as exc:
            fail(str(exc), EXIT_BAD_INPUT)
        except ImportError as exc:
            fail(str(exc), EXIT_BAD_INPUT)
        except DatabaseUnavailable as exc:
            fail(str(exc), EXIT_FAILED)

    return wrapper  # type: ignore[return-value]


@app.callback()
def main_options(
    config: Annotated[str | None, typer.Option("--config", help="Path to orgchart.toml.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO.")] = False,
) -> None:
    """Global options."""
    if config:
        os.environ["ORGCHART_CONFIG"] = config
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


# ---------------------------------------------------------------------- shared options
AgentOpt = Annotated[str, typer.Option("--agent", help="Agent that receives the goal.")]
TypeOpt = Annotated[str | None, typer.Option("--type", help="Task type (agent's default).")]
PriorityOpt = Annotated[int, typer.Option("--priority", help="Lower is more urgent.")]
TokensOpt = Annotated[int, typer.Option("--budget-tokens", help="Tree-wide token budget.")]
SecondsOpt = Annotated[int, typer.Option("--budget-seconds", help="Seconds per run.")]
UsdOpt = Annotated[str, typer.Option("--budget-usd", help="Tree-wide USD budget.")]
PayloadOpt = Annotated[str | None, typer.Option("--payload", help="Extra payload (JSON).")]
SuccessOpt = Annotated[str | None, typer.Option("--success", help="success_criteria JSON.")]
KillOpt = Annotated[str | None, typer.Option("--kill", help="kill_criteria JSON.")]
KeyOpt = Annotated[str | None, typer.Option("--idempotency-key", help="Deduplicates submits.")]
ModulesOpt = Annotated[list[str] | None, typer.Option(
    "--agents-module", help="Import agents (and policies) from this module; repeatable.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _submit(runtime: Any, goal: str, agent: str, type_: str | None, priority: int,
            budget_tokens: int, budget_seconds: int, budget_usd: str, payload: str | None,
            success: str | None, kill: str | None, key: str | None) -> tuple[dict[str, Any],
                                                                          bool]:
    from runtime.wiring import build_root, parse_json_option

    new = build_root(
        runtime.registry, runtime.settings, goal=goal, agent=agent, type_=type_,
        priority=priority, budget_tokens=budget_tokens, budget_seconds=budget_seconds,
        budget_usd=budget_usd, payload=parse_json_option("--payload", payload),
        success=parse_json_option("--success", success),
        kill=parse_json_option("--kill", kill), idempotency_key=key,
    )
    return runtime.store.submit(new, actor="cli")


def _runtime(modules: list[str] | None, announce: bool = True) -> Any:
    from runtime.wiring import build_runtime

    runtime = build_runtime(settings(), modules or [])
    if announce and getattr(runtime.llm_factory, "announcement", None):
        err.print(runtime.llm_factory.announcement, style="dim", markup=False, highlight=False)
    return runtime


@app.command()
@guarded
def submit(goal: str, agent: AgentOpt = "ceo", type_: TypeOpt = None, priority: PriorityOpt = 5,
           budget_tokens: TokensOpt = 50_000, budget_seconds: SecondsOpt = 300,
           budget_usd: UsdOpt = "1.0", payload: PayloadOpt = None, success: SuccessOpt = None,
           kill: KillOpt = None, idempotency_key: KeyOpt = None,
           agents_module: ModulesOpt = None, json_: JsonOpt = False) -> None:
    """Submit a root goal; print its id (the root id)."""
    from types import SimpleNamespace

    from runtime.views import task_json
    from runtime.wiring import load_registry, open_store

    # Submitting needs the agents' schemas and the database, not the model backend.
    config = settings()
    registry = load_registry(config, agents_module or [])
    runtime = SimpleNamespace(settings=config, registry=registry, store=open_store(config))
    task, created = _submit(runtime, goal, agent, type_, priority, budget_tokens,
                            budget_seconds, budget_usd, payload, success, kill, idempotency_key)
    if json_:
        print_json({**task_json(task), "created": created})
    else:
        out.print(str(task["id"]), highlight=False)
        if not created:
            err.print("[dim]idempotency key seen before: returned the existing task[/]")


def _install_stop_signals(stop: Callable[[str], None]) -> None:
    def handler(signum: int, _frame: Any) -> None:
        stop(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


@app.command()
@guarded
def run(goal: str, agent: AgentOpt = "ceo", type_: TypeOpt = None, priority: PriorityOpt = 5,
        budget_tokens: TokensOpt = 50_000, budget_seconds: SecondsOpt = 300,
        budget_usd: UsdOpt = "1.0", payload: PayloadOpt = None, success: SuccessOpt = None,
        kill: KillOpt = None, idempotency_key: KeyOpt = None,
        agents_module: ModulesOpt = None, json_: JsonOpt = False,
        timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 600,
        ) -> None:
    """Submit a goal and drain it in this process, drawing the tree live; print the result."""
    from runtime.cli.render import render_tree
    from runtime.views import TreeFollower

    runtime = _runtime(agents_module)
    task, _ = _submit(runtime, goal, agent, type_, priority, budget_tokens, budget_seconds,
                      budget_usd, payload, success, kill, idempotency_key)
    root_id = task["id"]
    worker = runtime.worker(poll_interval_seconds=0.2, maintenance_interval_seconds=0.5)
    _install_stop_signals(worker.stop)
    thread = threading.Thread(target=worker.run, name="worker", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    live_screen = out.is_terminal and not json_

    current = TreeFollower(runtime.store, root_id).refresh  # reads what changed only

    tree = current()
    if live_screen:
        with Live(render_tree(tree), console=out, refresh_per_second=8) as live:
            while tree["status"] not in TERMINAL_STATUSES and time.monotonic() < deadline \
                    and thread.is_alive():
                time.sleep(0.2)
                tree = current()
                live.update(render_tree(tree))
    else:
        while tree["status"] not in TERMINAL_STATUSES and time.monotonic() < deadline \
                and thread.is_alive():
            time.sleep(0.1)
            tree = current()
    worker.stop("run finished")
    thread.join(timeout=30)
    tree = current()
    if json_:
        print_json(tree)
    elif not live_screen:
        out.print(render_tree(tree))
    err.print(f"root {root_id} (orgchart tree {root_id})", style="dim", markup=False,
              highlight=False)
    from runtime.views import critical_path_summary

    err.print(critical_path_summary(runtime.store, root_id), markup=False, highlight=False,
              soft_wrap=True)
    if tree["status"] not in TERMINAL_STATUSES:
        fail(f"root {root_id} is still {tree['status']} after {timeout:g}s", EXIT_FAILED)
    if tree["status"] != "done":
        err.print(f"root {root_id} ended {tree['status']}: {tree.get('error') or ''}",
                  markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED)


@app.command()
@guarded
def worker(
    agents: Annotated[str | None, typer.Option(
        help="Comma-separated agents to serve ('judge' = the judge stage); default all.")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Tasks run at once.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Most tasks per claim.")] = None,
    task_cap: Annotated[int | None, typer.Option(help="Exit after claiming N tasks.")] = None,
    wall_clock: Annotated[float | None, typer.Option(help="Exit after S seconds.")] = None,
    lease_seconds: Annotated[float | None, typer.Option(help="Lease length.")] = None,
    once: Annotated[bool, typer.Option(help="Exit when the queue is empty.")] = False,
    no_maintenance: Annotated[bool, typer.Option(
        help="Do not run the reaper, watchdog and sweeper.")] = False,
    worker_id: Annotated[str | None, typer.Option(
        help="Name written as lease_owner and in task_events (default host:pid:random).")]
    = None,
    agents_module: ModulesOpt = None, json_: JsonOpt = False,
) -> None:
    """Claim and run tasks until stopped (SIGTERM/SIGINT), a cap, or an empty queue."""
    runtime = _runtime(agents_module)
    names = [a.strip() for a in agents.split(",") if a.strip()] if agents else None
    w = runtime.worker(names, concurrency=concurrency, batch_size=batch_size,
                       task_cap=task_cap, wall_clock_seconds=wall_clock,
                       lease_seconds=lease_seconds, once=once,
                       maintenance=not no_maintenance, worker_id=worker_id)
    _install_stop_signals(w.stop)
    err.print(f"worker {w.config.worker_id} serving {', '.join(w.config.agents)}",
              style="dim", markup=False, highlight=False)
    stats = w.run()
    if json_:
        print_json({"worker": w.config.worker_id, **stats.as_dict()})
    else:
        err.print(f"worker {w.config.worker_id} stopped ({stats.stop_reason}): claimed "
                  f"{stats.claimed}, outcomes {dict(stats.outcomes)}, delegated "
                  f"{stats.delegated}, stale {stats.stale}", markup=False, highlight=False)


@app.command("agents")
@guarded
def agents_cmd(agents_module: ModulesOpt = None, json_: JsonOpt = False) -> None:
    """List registered agents: types, delegation targets, input and output schemas."""
    from runtime.wiring import load_registry

    described = load_registry(settings(), agents_module or []).describe()
    if json_:
        print_json(described)
        return
    table = Table("agent", "types", "delegates to", "input fields", "output fields", "module")
    for a in described:
        table.add_row(a["name"], ", ".join(a["types"]), ", ".join(a["delegates_to"]) or "-",
                      ", ".join(a["input_schema"].get("properties", {})),
                      ", ".join(a["output_schema"].get("properties", {})), a["module"])
    out.print(table)


@db_app.command("upgrade")
@guarded
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Run the migrations (they also run automatically on first use)."""
    url = resolve_url(settings().database.url)
    upgrade(url, revision)
    out.print(f"database at {redacted(url)} is at {revision}", highlight=False)


@db_app.command("url")
@guarded
def db_url() -> None:
    """Print the database URL orgchart uses (password hidden)."""
    out.print(redacted(resolve_url(settings().database.url)), highlight=False)


for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(app)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
