"""``orgchart llm``: which model backend runs, and recording a run for replay.

- ``orgchart llm check`` says which backend ``[llm] backend`` gives and why (for ``auto``:
  whether Ollama answered).
- ``orgchart llm record ROOT_ID --out FILE`` writes the model calls of every task in that
  tree as a JSONL replay file; run with ``[llm] backend = "replay"`` and ``[llm]
  replay_file = FILE`` to get the same responses without a model server.

Exit status: 0 on success, 1 when the database cannot be reached, 2 on bad input (a bad
id, no such task, a bad configuration).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer

from runtime.config import ConfigError, Settings, load_settings
from runtime.llm.backends import (
    BackendConfigError,
    build_backend,
    records_from_calls,
    write_replay_file,
)
from runtime.store.rows import NotFound
from runtime.store.store import Store

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def register(app: typer.Typer) -> None:
    """Add the ``llm`` sub-command group to the ``orgchart`` app."""
    llm_app = typer.Typer(help="Model backends: check which one runs; record a run for replay.",
                          no_args_is_help=True)

    @llm_app.command("check")
    def check(ctx: typer.Context, as_json: JsonFlag = False) -> None:
        """Say which model backend the llm.backend setting gives, and why."""
        settings = _settings(ctx)
        try:
            backend, why = build_backend(settings)
        except BackendConfigError as exc:
            _fail(str(exc))
        try:
            if as_json:
                typer.echo(json.dumps({"backend": backend.name, "reason": why,
                                       "configured": settings.llm.backend,
                                       "ollama_url": settings.ollama.url}))
            else:
                typer.echo(why)
        finally:
            close = getattr(backend, "close", None)
            if close is not None:
                close()

    @llm_app.command("record")
    def record(
        ctx: typer.Context,
        root_id: Annotated[str, typer.Argument(help="The root task whose tree to record.")],
        out: Annotated[Path, typer.Option("--out", "-o", help="The JSONL replay file to write.")],
        as_json: JsonFlag = False,
    ) -> None:
        """Write a replay file from the model calls of every task in a tree."""
        settings = _settings(ctx)
        try:
            root = uuid.UUID(root_id)
        except ValueError:
            _fail(f"not a task id: {root_id!r}")
        store = _open_store(settings)
        try:
            try:
                task = store.get(root)
            except NotFound:
                _fail(f"no task {root}")
            if task["parent_id"] is not None:
                _fail(f"task {root} is not a root; record its tree with its root id "
                      f"{task['root_id']}")
            calls = store.query("model_call_list_tree", root_id=root)
        finally:
            store.dispose()
        records = records_from_calls(calls)
        written = write_replay_file(out, records)
        skipped = len(calls) - written
        tasks = len({c["task_id"] for c in calls})
        if as_json:
            typer.echo(json.dumps({"root_id": str(root), "file": str(out), "records": written,
                                   "skipped": skipped, "tasks": tasks}))
            return
        note = f" ({skipped} failed or unrecorded calls skipped)" if skipped else ""
        typer.echo(f"wrote {written} responses from {len(calls)} model calls of {tasks} tasks "
                   f"in tree {root} to {out}{note}")

    app.add_typer(llm_app, name="llm")


def _fail(message: str) -> Any:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def _settings(ctx: typer.Context) -> Settings:
    """Return the settings the main app loaded (``ctx.obj``), else load them here."""
    obj = ctx.find_root().obj
    for candidate in (obj, getattr(obj, "settings", None),
                      obj.get("settings") if isinstance(obj, dict) else None):
        if isinstance(candidate, Settings):
            return candidate
    try:
        return load_settings()
    except ConfigError as exc:
        return _fail(str(exc))


def _open_store(settings: Settings) -> Store:
    from runtime.store.db import DatabaseUnavailable
    from runtime.wiring import open_store  # not at import time: the CLI loads this module early

    try:
        return open_store(settings)
    except DatabaseUnavailable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from None
