"""The ``orgchart`` command line: the Typer app and the list of its commands.

The commands are plain functions defined at module level in small modules (running
goals, inspecting trees, operations, policies, model backends, configuration); this
module adds each one to the app wrapped in the one error handler,
:func:`runtime.cli.common.handled`. Exit status: 0 on success, 1 when a run's root ended
failed or escalated, the database cannot be reached or the runtime failed, 2 on bad
input. Every listing has ``--json``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from runtime.cli import (
    audit,
    configuration,
    experiments,
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

app = typer.Typer(
    name="orgchart",
    help="A durable runtime for hierarchical multi-agent systems on PostgreSQL.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="Database commands.", no_args_is_help=True)
llm_app = typer.Typer(help="Model backends: check which one runs; record a run for replay.",
                      no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(llm_app, name="llm")
webhooks_app = typer.Typer(help="Webhooks: endpoints, deliveries, tests.", no_args_is_help=True)
app.add_typer(webhooks_app, name="webhooks")
schedule_app = typer.Typer(help="Schedules in the database: recurring goals and the fire.",
                           no_args_is_help=True)
app.add_typer(schedule_app, name="schedule")

dataset_app = typer.Typer(help="Datasets of cases for experiments.", no_args_is_help=True)
experiment_app = typer.Typer(help="Experiments: a dataset under variants, scored against "
                             "the baseline.", no_args_is_help=True)
app.add_typer(dataset_app, name="dataset")
app.add_typer(experiment_app, name="experiment")
#: Every command: (group, name, function). Each is added wrapped in ``handled``.
COMMANDS: tuple[tuple[typer.Typer, str, Callable[..., Any]], ...] = (
    (app, "submit", running.submit),
    (app, "run", running.run),
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
    _group.command(_name)(handled(_command))


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


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
