"""Steering a running tree: cancel, pause, resume, inbox, answer, approve, reject.

Each command is one call of :class:`runtime.store.steering.StoreSteering` and prints
what it did (``--json``: the shape of ``runtime.views.steer_json``, as the HTTP API
answers). A no-op (cancelling a finished task, a second approve, pausing a paused tree)
exits 0 and says so; an unknown task, a malformed id or an answer that does not fit its
question exits 2 and changes nothing.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from runtime.cli.common import JsonOpt, opened_store, out, print_json
from runtime.views import inbox_json, parse_task_id, steer_json
from runtime.wiring import check_storable, parse_json_option

NoteOpt = Annotated[str | None, typer.Option("--note", help="Why (kept in the history).")]
ByOpt = Annotated[str, typer.Option("--by", help="Who does it (kept in the history).")]


def _say(outcome: Any, json_: bool) -> None:
    if json_:
        print_json(steer_json(outcome))
        return
    changed = getattr(outcome, "changed", getattr(outcome, "cancelled", 0))
    out.print(escape(outcome.message), style=None if changed else "yellow")


def cancel(task_id: Annotated[str, typer.Argument(help="The task to cancel, with its subtree.")],
           note: NoteOpt = None, by: ByOpt = "cli", json_: JsonOpt = False) -> None:
    """Cancel a task and every open task below it (they end ``cancelled``)."""
    tid = parse_task_id(task_id)
    check_storable(note, "--note")
    with opened_store() as store:
        _say(store.cancel(tid, actor=by, note=note), json_)


def pause(root_id: Annotated[str, typer.Argument(help="The root of the tree to pause.")],
          note: NoteOpt = None, by: ByOpt = "cli", json_: JsonOpt = False) -> None:
    """Pause a tree: its tasks are not claimed and start no model call until resumed."""
    rid = parse_task_id(root_id, "root id")
    check_storable(note, "--note")
    with opened_store() as store:
        _say(store.pause(rid, actor=by, note=note), json_)


def resume(root_id: Annotated[str, typer.Argument(help="The root of the paused tree.")],
           by: ByOpt = "cli", json_: JsonOpt = False) -> None:
    """Resume a paused tree where it stood."""
    rid = parse_task_id(root_id, "root id")
    with opened_store() as store:
        _say(store.resume(rid, actor=by), json_)


def inbox(json_: JsonOpt = False) -> None:
    """What waits for a person: questions, approvals and escalations, oldest first."""
    with opened_store() as store:
        items = [inbox_json(r) for r in store.inbox()]
    if json_:
        print_json(items)
        return
    if not items:
        out.print("the inbox is empty")
        return
    table = Table("kind", "id", "root", "asking", "question", "answer", "age")
    for i in items:
        shape = (", ".join(map(str, i["choices"])) if i["choices"]
                 else "schema" if i["answer_schema"] else "-")
        table.add_row(i["kind"], i["id"], i["root_id"][:8], escape(str(i["asking_agent"] or "-")),
                      escape(str(i["question"] or "")[:120]), escape(shape),
                      f"{i['age_seconds']:.0f}s")
    out.print(table)
    out.print("[dim]orgchart answer TASK_ID --json '...' | approve TASK_ID | "
              "reject TASK_ID --note TEXT | resolve TASK_ID ...[/]")


def answer(task_id: Annotated[str, typer.Argument(help="The question's task id.")],
           json_text: Annotated[str, typer.Option(
               "--json", metavar="JSON", help="The answer, as JSON.")],
           by: ByOpt = "cli") -> None:
    """Answer a question to ``human``: checked against its schema, then ``done``."""
    tid = parse_task_id(task_id)
    value = parse_json_option("--json", json_text)
    check_storable(value, "the answer")
    with opened_store() as store:
        _say(store.answer(tid, value, actor=by), False)


def approve(task_id: Annotated[str, typer.Argument(help="The task awaiting approval.")],
            note: NoteOpt = None, by: ByOpt = "cli", json_: JsonOpt = False) -> None:
    """Let a task held for approval run (an approval is used once)."""
    tid = parse_task_id(task_id)
    check_storable(note, "--note")
    with opened_store() as store:
        _say(store.approve(tid, actor=by, note=note), json_)


def reject(task_id: Annotated[str, typer.Argument(help="The task awaiting approval.")],
           note: Annotated[str, typer.Option("--note", help="Why (required).")] = "",
           by: ByOpt = "cli", json_: JsonOpt = False) -> None:
    """Fail a task held for approval with a note; its parent decides as for any failure."""
    tid = parse_task_id(task_id)
    check_storable(note, "--note")
    with opened_store() as store:
        _say(store.reject(tid, note=note, actor=by), json_)
