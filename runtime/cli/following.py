"""``orgchart follow ROOT``: a tree's transitions and model-call text as they happen.

It reads the tree's stream from the database (:mod:`runtime.store.streams`: the same
events as ``GET /trees/{root_id}/stream``) and prints each transition on a line of its
own and each call's text as it grows, under a header naming the task and the call; a
newer attempt of a call (a retry) is announced, then its text follows. When the root
ends it prints the root's answer, as ``orgchart run`` does, and exits 1 unless the root
ended ``done``. ``--quiet`` prints only the answer; ``--json`` one JSON object per event
(``{"event", "id", "data"}``); ``--after ID`` resumes after an event id.

:class:`StreamPrinter` is shared with ``orgchart run``, which prints the live text above
its tree (whole lines there: a live display redraws below them).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from runtime.cli.common import EXIT_FAILED, JsonOpt, TaskRef, err, fail, opened_store
from runtime.store.streams import Position, StreamEvent, StreamReader
from runtime.store.streams import follow as follow_stream


class StreamPrinter:
    """Turns stream events into text for a person.

    Args:
        write: where the text goes (a terminal's ``write``).
        whole_lines: hold a call's text until a line is complete (for a live display,
            which redraws under what was printed); else it is written as it arrives.

    """

    def __init__(self, write: Callable[[str], None], whole_lines: bool = False) -> None:
        self.write = write
        self.whole_lines = whole_lines
        self.agents: dict[str, str] = {}
        self._call: tuple[str, str, int, int] | None = None
        self._line = ""

    def _name(self, task_id: str) -> str:
        agent = self.agents.get(task_id)
        return f"{agent} {task_id[:8]}" if agent else task_id[:8]

    def _close_text(self) -> None:
        """End the text of the current call (a newline, or the held partial line)."""
        if self._call is None:
            return
        if self.whole_lines:
            if self._line:
                self.write(f"  {self._line}\n")
        else:
            self.write("\n")
        self._call, self._line = None, ""

    def show(self, event: StreamEvent) -> None:
        """Print one event."""
        data = event.data
        if event.kind == "transition":
            if data.get("agent"):
                self.agents[data["task_id"]] = data["agent"]
            self._close_text()
            self.write(f"{self._name(data['task_id'])}: {data['from'] or 'new'} -> "
                       f"{data['to']}\n")
        elif event.kind == "superseded":
            self._close_text()
            self.write(f"{self._name(data['task_id'])}: {data['phase']} call "
                       f"{data['call']}: attempt {data['attempt']} superseded by attempt "
                       f"{data['by']}\n")
        elif event.kind == "text":
            self._text(data)

    def _text(self, data: dict[str, Any]) -> None:
        key = (data["task_id"], data["phase"], data["call"], data["attempt"])
        if key != self._call:
            self._close_text()
            self._call = key
            attempt = f", attempt {key[3]}" if key[3] > 1 else ""
            self.write(f"{self._name(key[0])} {key[1]} call {key[2]}{attempt}:\n")
        if not self.whole_lines:
            self.write(data["text"])
            return
        lines = (self._line + data["text"]).split("\n")
        self._line = lines.pop()
        for line in lines:
            self.write(f"  {line}\n")

    def finish(self) -> None:
        """End the text in progress (the stream ended)."""
        self._close_text()


def _write_out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def follow(
    root_id: Annotated[str, typer.Argument(help="The root task's id (or a unique prefix).")],
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="Print only the root's answer when the tree ends.")] = False,
    after: Annotated[str | None, typer.Option(
        "--after", help="Resume after this event id (--json prints them).")] = None,
    json_: JsonOpt = False,
) -> None:
    """Print a tree's transitions and model-call text as they happen, until the root ends.

    Then print the root's answer; exit 1 unless the root ended done. A finished tree is
    printed from its start.
    """
    from runtime.cli.running import print_answer
    from runtime.views import task_json

    ref = TaskRef.parse(root_id, "root id")
    position = Position.parse(after)
    printer = StreamPrinter(_write_out)
    with opened_store() as store:
        rid = ref.resolve(store)
        reader = StreamReader(store.engine)
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
        root = store.get(rid)
    tree = task_json(root)
    if not json_:
        print_answer(tree)
    if tree["status"] != "done":
        err.print(f"root {rid} ended {tree['status']}: {tree.get('error') or ''}",
                  markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED)
