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
from pathlib import Path
from typing import Annotated

import typer

from runtime.cli.common import JsonOpt, TaskRef, fail, opened_store, settings
from runtime.llm.backends.choice import build_backend
from runtime.llm.backends.replay import records_from_calls, write_replay_file
from runtime.llm.reply import BackendConfigError
from runtime.store.rows import NotFound


def check(as_json: JsonOpt = False) -> None:
    """Say which model backend the llm.backend setting gives, and why."""
    config = settings()
    try:
        backend, why = build_backend(config)
    except BackendConfigError as exc:
        fail(str(exc))
    try:
        if as_json:
            typer.echo(json.dumps({"backend": backend.name, "reason": why,
                                   "configured": config.llm.backend,
                                   "ollama_url": config.ollama.url}))
        else:
            typer.echo(why)
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()


def record(
    root_id: Annotated[str, typer.Argument(help="The root task whose tree to record.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The JSONL replay file to write.")],
    as_json: JsonOpt = False,
) -> None:
    """Write a replay file from the model calls of every task in a tree."""
    config = settings()
    ref = TaskRef.parse(root_id, "root id")
    with opened_store(config) as store:
        try:
            root = ref.resolve(store)
            task = store.reads.get(root)
        except NotFound as exc:
            fail(str(exc))
        if task["parent_id"] is not None:
            fail(f"task {root} is not a root; record its tree with its root id "
                 f"{task['root_id']}")
        calls = store.database.query("model_call_list_tree", root_id=root)
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
