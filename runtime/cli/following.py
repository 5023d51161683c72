"""``orgchart follow ROOT``: a tree's transitions and model-call text as they happen.

It reads the tree's stream from the database (:mod:`runtime.store.streams`: the same
events as ``GET /trees/{root_id}/stream``) and prints each transition on a line of its
own and each call's text as it grows, under a header naming the task and the call; a
newer attempt of a call (a retry) is announced, then its text follows. When the root
ends it prints the root's answer, as ``orgchart run`` does, and exits 1 unless the root
ended ``done``. ``--quiet`` prints only the answer; ``--json`` one JSON object per event
(``{"event", "id", "data"}``); ``--after ID`` resumes after an event id.

The printing is :class:`runtime.cli.render.StreamPrinter`'s, shared with ``orgchart
run`` (which prints the live text above its tree).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from runtime.cli.common import EXIT_FAILED, JsonOpt, TaskRef, err, fail, opened_store
from runtime.cli.render import StreamPrinter
from runtime.store.streams import Position
from runtime.store.streams import follow as follow_stream


def _write_out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def follow(
    root_id: Annotated[str, typer.Argument(help="The root task's id (or a unique prefix).")],
    quiet: Annotated[bool, typer.Option(
        "--quiet", help="Print only the root's answer when the tree ends.")] = False,
    after: Annotated[str | None, typer.Option(
        "--after", help="Resume after this event id (--json prints them).")] = None,
    json_: JsonOpt = False,
) -> None:
    """Print a tree's transitions and model-call text as they happen, until the root ends.

    Then the root's answer; exit 1 unless it ended done. A finished tree: from its start.
    """
    from runtime.cli.running import print_answer
    from runtime.views import task_json

    ref = TaskRef.parse(root_id, "root id")
    position = Position.parse(after)
    printer = StreamPrinter(_write_out)
    with opened_store() as store:
        rid = ref.resolve(store)
        reader = store.streams
        if not reader.exists(rid):
            fail(f"{rid} is not a root: follow a tree by its root's id")
        try:
            for event in follow_stream(reader, rid, position):
                if json_:
                    _write_out(json.dumps(event.as_json(), ensure_ascii=False) + "\n")
                elif not quiet:
                    printer.show(event)
        except KeyboardInterrupt:
            printer.finish()
            return
        printer.finish()
        root = store.reads.get(rid)
    tree = task_json(root)
    if not json_:
        print_answer(tree)
    if tree["status"] != "done":
        err.print(f"root {rid} ended {tree['status']}: {tree.get('error') or ''}",
                  markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED)
