"""Steering and sharing a tree: cancel, pause, resume, inbox, answer, approve, fork, diff.

``reject`` is ``approve``'s opposite.

Each command is one call of :class:`runtime.store.steering.Steering` and prints
what it did (``--json``: the shape of ``runtime.views.steer_json``, as the HTTP API
answers). A no-op (cancelling a finished task, a second approve, pausing a paused tree)
exits 0 and says so. An id is a whole UUID or a unique prefix of one (as ``tree`` prints
it). An unknown task, a malformed or ambiguous id or an answer that does not fit its
question exits 2 and changes nothing.

``fork TASK_ID`` creates a branch, a new tree that re-runs TASK_ID's tree from its root
with the overrides at TASK_ID (``--payload``, ``--agent``; ``--model`` also for its
subtree); with none it is a re-run, which after a prompt file or an agent's code changed
pays only for the calls whose requests changed. Bad overrides exit 2 and create nothing.
``diff A B`` shows two trees side by side, task by task.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from runtime.cli.common import (
    JsonOpt,
    ModulesOpt,
    TaskRef,
    err,
    opened_store,
    out,
    print_json,
    settings,
)
from runtime.errors import BadInput
from runtime.views import inbox_json, steer_json, task_json
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
    ref = TaskRef.parse(task_id)
    check_storable(note, "--note")
    with opened_store() as store:
        _say(store.steering.cancel(ref.resolve(store), actor=by, note=note), json_)


def pause(root_id: Annotated[str, typer.Argument(help="The root of the tree to pause.")],
          note: NoteOpt = None, by: ByOpt = "cli", json_: JsonOpt = False) -> None:
    """Pause a tree: its tasks are not claimed and start no model call until resumed."""
    ref = TaskRef.parse(root_id, "root id")
    check_storable(note, "--note")
    with opened_store() as store:
        _say(store.steering.pause(ref.resolve(store), actor=by, note=note), json_)


def resume(root_id: Annotated[str, typer.Argument(help="The root of the paused tree.")],
           by: ByOpt = "cli", json_: JsonOpt = False) -> None:
    """Resume a paused tree where it stood."""
    ref = TaskRef.parse(root_id, "root id")
    with opened_store() as store:
        _say(store.steering.resume(ref.resolve(store), actor=by), json_)


def inbox(json_: JsonOpt = False) -> None:
    """What waits for a person: questions, approvals and escalations, oldest first."""
    with opened_store() as store:
        items = [inbox_json(r) for r in store.steering.inbox()]
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
    ref = TaskRef.parse(task_id)
    value = parse_json_option("--json", json_text)
    check_storable(value, "the answer")
    with opened_store() as store:
        _say(store.steering.answer(ref.resolve(store), value, actor=by), False)


def approve(task_id: Annotated[str, typer.Argument(help="The task awaiting approval.")],
            note: NoteOpt = None, by: ByOpt = "cli", json_: JsonOpt = False) -> None:
    """Let a task held for approval run (an approval is used once)."""
    ref = TaskRef.parse(task_id)
    check_storable(note, "--note")
    with opened_store() as store:
        _say(store.steering.approve(ref.resolve(store), actor=by, note=note), json_)


def reject(task_id: Annotated[str, typer.Argument(help="The task awaiting approval.")],
           note: Annotated[str, typer.Option("--note", help="Why (required).")] = "",
           by: ByOpt = "cli", json_: JsonOpt = False) -> None:
    """Fail a task held for approval with a note; its parent decides as for any failure."""
    ref = TaskRef.parse(task_id)
    check_storable(note, "--note")
    with opened_store() as store:
        _say(store.steering.reject(ref.resolve(store), note=note, actor=by), json_)


def _payload(text: str | None) -> dict[str, object] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"--payload is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadInput(f"--payload must be a JSON object, not {type(value).__name__}")
    return value


def fork(
    task_id: Annotated[str, typer.Argument(help="The task to fork at (a root: a re-run).")],
    payload: Annotated[str | None, typer.Option(
        help="The task's new payload (JSON object, checked against the agent's schema).")]
    = None,
    agent: Annotated[str | None, typer.Option(help="Run the task with this agent.")] = None,
    model: Annotated[str | None, typer.Option(
        help="The model of the task's calls and its subtree's (one with a price).")] = None,
    note: Annotated[str | None, typer.Option(help="Why (kept in the branch's history).")]
    = None,
    budget_tokens: Annotated[int | None, typer.Option(
        help="The branch's token budget (default: the original root's).")] = None,
    budget_usd: Annotated[str | None, typer.Option(
        help="The branch's USD budget (default: the original root's).")] = None,
    run: Annotated[bool, typer.Option(
        "--run", help="Drain the branch in this process, as 'orgchart run' does.")] = False,
    timeout: Annotated[float, typer.Option(help="With --run: give up after seconds.")] = 600,
    agents_module: ModulesOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Fork a tree: a new tree re-runs it from its root, with overrides at TASK_ID."""
    from runtime.forks.branch import fork as fork_tree
    from runtime.wiring import load_registry, open_store

    ref = TaskRef.parse(task_id)
    usd = None
    if budget_usd is not None:
        try:
            usd = Decimal(budget_usd)
        except ArithmeticError:
            raise BadInput(f"--budget-usd {budget_usd!r} is not a number") from None
    config = settings()
    if run:
        from runtime.cli.common import open_runtime
        from runtime.cli.running import drain

        runtime = open_runtime(agents_module)
        store, registry = runtime.store, runtime.registry
    else:
        store, registry = open_store(config), load_registry(config, agents_module or [])
    branch = fork_tree(store, registry, config, ref.resolve(store), actor="cli",
                       payload=_payload(payload), agent=agent, model=model, note=note,
                       budget_tokens=budget_tokens, budget_usd=usd)
    if run:
        err.print(f"branch {branch['id']} of {branch['forked_from']}", style="dim",
                  markup=False, highlight=False)
        drain(runtime, branch["id"], json_, timeout, None)
        return
    if json_:
        print_json({**task_json(branch), "created": True})
    else:
        out.print(str(branch["id"]), highlight=False)
        err.print(f"branch of {branch['forked_from']}; compare with: orgchart diff "
                  f"{branch['forked_from']} {branch['id']}", style="dim", markup=False,
                  highlight=False)


def diff(
    root_a: Annotated[str, typer.Argument(help="The first tree's root id.")],
    root_b: Annotated[str, typer.Argument(help="The second tree's root id.")],
    json_: JsonOpt = False,
) -> None:
    """Compare two trees task by task (paired by path of child keys)."""
    from runtime.forks.diff import diff_lines, diff_trees

    a, b = TaskRef.parse(root_a, "root id"), TaskRef.parse(root_b, "root id")
    with opened_store() as store:
        result = diff_trees(store, a.resolve(store), b.resolve(store))
    if json_:
        print_json(result)
        return
    for line in diff_lines(result):
        out.print(line, markup=False, highlight=False, soft_wrap=True)
