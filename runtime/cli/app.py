"""The ``orgchart`` command line: the Typer app and the list of its commands.

The commands are plain functions defined at module level in small modules (running
goals, inspecting trees, operations, policies, model backends, configuration); this
module adds each one to the app wrapped in the one error handler,
:func:`runtime.cli.common.handled`. Exit status: 0 on success, 1 when a run's root ended
failed or escalated, the database cannot be reached or the runtime failed, 2 on bad
input. Every listing has ``--json``.

Help is text, not rich markup: ``[worker]`` and ``[tenants.<name>]`` name configuration
sections and stay on screen (:class:`TextHelpCommand`); a flag shows no ``<bool>``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Annotated, Any

import click
import typer
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from runtime.cli import (
    audit,
    configuration,
    experiments,
    following,
    inspection,
    models,
    ops,
    policies,
    running,
    schedules,
    steering,
    webhooks,
)
from runtime.cli.common import handled


class _TextHelp:
    """Help texts are escaped once, when the command is built; flags show no type.

    Typer renders help as rich markup, where ``[worker]`` is a style tag and vanishes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        me: Any = self
        me.help = escape(me.help) if me.help else me.help
        me.short_help = escape(me.short_help) if me.short_help else me.short_help
        for param in me.params:
            if getattr(param, "help", None):
                param.help = escape(param.help)
            _no_bool_metavar(param)

    def get_help_option(self, ctx: click.Context) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            _no_bool_metavar(option)
        return option


def _no_bool_metavar(param: click.Parameter) -> None:
    descriptor = getattr(param, "type_descriptor", None)
    flag = getattr(param, "is_flag", False) or getattr(descriptor, "annotation", None) is bool
    if param.param_type_name == "option" and flag and param.metavar is None:
        param.metavar = ""  # not "<bool>": a flag takes no value


class TextHelpCommand(_TextHelp, TyperCommand):  # type: ignore[misc]
    """A command whose help is text (see :class:`_TextHelp`)."""


class TextHelpGroup(_TextHelp, TyperGroup):  # type: ignore[misc]
    """A group whose help is text (see :class:`_TextHelp`)."""


def _typer(**options: Any) -> typer.Typer:
    return typer.Typer(cls=TextHelpGroup, **options)


app = _typer(
    name="orgchart",
    help="A durable runtime for hierarchical multi-agent systems on PostgreSQL.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = _typer(help="Database commands.", no_args_is_help=True)
llm_app = _typer(help="Model backends: check which one runs; record a run for replay.",
                      no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(llm_app, name="llm")
webhooks_app = _typer(help="Webhooks: endpoints, deliveries, tests.", no_args_is_help=True)
app.add_typer(webhooks_app, name="webhooks")
schedule_app = _typer(help="Schedules in the database: recurring goals and the fire.",
                           no_args_is_help=True)
app.add_typer(schedule_app, name="schedule")

dataset_app = _typer(help="Datasets of cases for experiments.", no_args_is_help=True)
experiment_app = _typer(help="Experiments: a dataset under variants, scored against "
                             "the baseline.", no_args_is_help=True)
app.add_typer(dataset_app, name="dataset")
app.add_typer(experiment_app, name="experiment")
#: Every command: (group, name, function). Each is added wrapped in ``handled``.
COMMANDS: tuple[tuple[typer.Typer, str, Callable[..., Any]], ...] = (
    (app, "submit", running.submit),
    (app, "run", running.run),
    (app, "follow", following.follow),
    (app, "worker", running.worker),
    (app, "agents", running.agents),
    (app, "tree", inspection.tree),
    (app, "show", inspection.show),
    (app, "fork", steering.fork),
    (app, "diff", steering.diff),
    (app, "escalations", inspection.escalations),
    (app, "resolve", inspection.resolve),
    (app, "cancel", steering.cancel),
    (app, "pause", steering.pause),
    (app, "resume", steering.resume),
    (app, "inbox", steering.inbox),
    (app, "answer", steering.answer),
    (app, "approve", steering.approve),
    (app, "reject", steering.reject),
    (app, "metrics", inspection.metrics),
    (app, "prune", inspection.prune),
    (app, "serve", inspection.serve),
    (app, "mcp", inspection.mcp),
    (app, "fire", ops.fire),
    (app, "doctor", ops.doctor),
    (app, "audit", audit.audit_command),
    (app, "policies", policies.policies),
    (app, "config", configuration.config),
    (db_app, "upgrade", ops.db_upgrade),
    (db_app, "url", ops.db_url),
    (llm_app, "check", models.check),
    (llm_app, "record", models.record),
    (dataset_app, "add", experiments.dataset_add),
    (dataset_app, "list", experiments.dataset_list),
    (dataset_app, "from-roots", experiments.dataset_from_roots),
    (experiment_app, "run", experiments.experiment_run),
    (experiment_app, "show", experiments.experiment_show),
    (experiment_app, "list", experiments.experiment_list),
    (experiment_app, "rescore", experiments.experiment_rescore),
    (experiment_app, "delete", experiments.experiment_delete),
    (schedule_app, "add", schedules.add),
    (schedule_app, "list", schedules.list_),
    (schedule_app, "runs", schedules.runs),
    (schedule_app, "pause", schedules.pause),
    (schedule_app, "resume", schedules.resume),
    (schedule_app, "remove", schedules.remove),
    (schedule_app, "run-now", schedules.run_now_),
    (webhooks_app, "add", webhooks.add),
    (webhooks_app, "list", webhooks.list_),
    (webhooks_app, "test", webhooks.test),
    (webhooks_app, "deliveries", webhooks.deliveries),
    (webhooks_app, "redeliver", webhooks.redeliver),
)

for _group, _name, _command in COMMANDS:
    _group.command(_name, cls=TextHelpCommand)(handled(_command))


def version_text() -> str:
    """``orgchart X.Y.Z``, from the installed package's metadata."""
    try:
        return f"orgchart {metadata.version('orgchart')}"
    except metadata.PackageNotFoundError:
        return "orgchart (not installed: no package metadata; pip install -e .)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


@app.callback()
def main_options(
    config: Annotated[str | None, typer.Option("--config", help="Path to orgchart.toml.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO.")] = False,
    version: Annotated[bool, typer.Option(
        "--version", help="Print the installed version and exit.", is_eager=True,
        callback=_print_version)] = False,
) -> None:
    """Global options."""
    if config:
        os.environ["ORGCHART_CONFIG"] = config
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
