"""Drawing task trees on a terminal with rich (``orgchart run``, ``orgchart tree``).

And a tree's stream as a person reads it (:class:`StreamPrinter`: ``orgchart follow``,
``orgchart run``), with :class:`LiveText`, the thread that prints a running tree's text.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from rich.text import Text
from rich.tree import Tree

from runtime.store.streams import StreamEvent, StreamReader, follow

log = logging.getLogger(__name__)

STATUS_STYLE = {
    "pending": "grey62",
    "running": "bold cyan",
    "waiting": "blue",
    "ready_to_aggregate": "bold blue",
    "judging": "magenta",
    "done": "bold green",
    "failed": "bold red",
    "escalated": "bold yellow",
    "cancelled": "bold bright_black",
    "awaiting_approval": "bold yellow",
}


#: Backends that answer without running the routed model: a price charged for their
#: calls is that model's configured price, an estimate (queries.sql fragment_task_served).
NOT_RUN_BACKENDS = ("offline", "replay")


def served_text(node: dict[str, Any]) -> str:
    """Which backend(s) served a task's calls, as a tree line shows it ("" without calls).

    ``offline (est.)``: the cost is a price for a model that did not run; ``ollama
    cloud:qwen3:14b``: the model that ran, on its route; several backends with their calls
    (``offline 2, replay 1``).
    """
    served: dict[str, int] = node.get("served_by") or {}
    if not served:
        return ""
    if len(served) == 1:
        (backend,) = served
        text = backend
        if backend not in NOT_RUN_BACKENDS and node.get("route"):
            text += f" {node['route']}:{node.get('model')}"
    else:
        text = ", ".join(f"{backend} {calls}" for backend, calls in sorted(served.items()))
    return text + (" (est.)" if node.get("cost_estimated") else "")


def node_label(node: dict[str, Any]) -> Text:
    """One line per task: status, agent, type, spend and who served it, duration, verdict."""
    label = Text()
    label.append(f"{node['status']:<18}", style=STATUS_STYLE.get(node["status"], ""))
    label.append(f" {node['agent']}", style="bold")
    label.append(f" ({node['type']})", style="dim")
    label.append(f"  {node['spent_tokens']} tok  ")
    served = served_text(node)
    if served:
        label.append(f"{served} ", style="yellow" if node.get("cost_estimated") else "dim")
    label.append(f"${float(node['spent_usd']):.5f}")
    label.append(f"  {float(node['duration_seconds']):.2f}s", style="dim")
    verdict = node.get("verdict")
    if verdict:
        label.append(f"  verdict {'pass' if verdict.get('passed') else 'fail'}"
                     f" {float(verdict.get('score') or 0):.2f}",
                     style="green" if verdict.get("passed") else "red")
    if node.get("error"):
        label.append(f"  error: {str(node['error'])[:160]}", style="red")
    label.append(f"  {str(node['id'])[:8]}", style="dim")
    return label


def render_tree(tree: dict[str, Any], max_nodes: int = 2000) -> Tree:
    """A rich Tree for a ``tree_json`` dict, totals in the root's label."""
    label = node_label(tree)
    if tree.get("tenant") not in (None, "default"):
        label.append(f"  tenant {tree['tenant']}", style="cyan")
    if tree.get("forked_from"):
        fork = tree.get("fork") or {}
        label.append(f"  branch of {tree['forked_from']}"
                     + (f" (at {str(fork['target'])[:8]})" if fork.get("target")
                        and fork["target"] != tree["forked_from"] else "")
                     + (f": {fork['note']}" if fork.get("note") else ""), style="magenta")
    root = Tree(label)
    shown = 1

    def add(parent: Tree, node: dict[str, Any]) -> None:
        nonlocal shown
        for child in node.get("children", []):
            if shown >= max_nodes:
                parent.add(Text(f"... {tree['totals']['tasks'] - shown} more", style="dim"))
                return
            shown += 1
            add(parent.add(node_label(child)), child)

    add(root, tree)
    totals = tree.get("totals")
    if totals:
        by_status = ", ".join(f"{k} {v}" for k, v in sorted(totals["by_status"].items()))
        root.add(Text(f"totals: {totals['tasks']} tasks ({by_status}); "
                      f"{totals['spent_tokens']} tokens; ${totals['spent_usd']}"
                      + served_totals_text(totals), style="bold"))
    return root


def served_totals_text(totals: dict[str, Any]) -> str:
    """The totals line's end: the calls per backend, and the spend that is an estimate."""
    served = totals.get("served_by") or {}
    if not served:
        return ""
    text = "; served by " + ", ".join(f"{backend} {calls} call{'s' if calls != 1 else ''}"
                                      for backend, calls in sorted(served.items()))
    estimated = float(totals.get("estimated_usd") or 0)
    if estimated:
        text += (f" (${totals['estimated_usd']} est.: the price of a model that did not "
                 "run, counted by budgets)")
    return text


class StreamPrinter:
    """Turns stream events into text for a person.

    Args:
        write: where the text goes (a terminal's ``write``).
        whole_lines: hold a call's text until a line is complete (for a live display,
            which redraws under what was printed); else it is written as it arrives.
        transitions: print the transitions too (a live tree shows them already).

    """

    def __init__(self, write: Callable[[str], None], whole_lines: bool = False,
                 transitions: bool = True) -> None:
        self.write = write
        self.whole_lines = whole_lines
        self.transitions = transitions
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
            if self.transitions:
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


#: Seconds a run's text printer gets, once the root ended, to print the stream's end.
LIVE_TEXT_DRAIN_SECONDS = 2.0


class LiveText:
    """A thread that prints a tree's stream (:class:`StreamPrinter`) while it runs.

    Args:
        reader: the store's stream reader (``store.streams``).
        root_id: the tree's root.
        write: where the text goes.
        whole_lines: see :class:`StreamPrinter`; a live tree: no transition lines either.

    """

    def __init__(self, reader: StreamReader, root_id: uuid.UUID, write: Callable[[str], None],
                 whole_lines: bool = False) -> None:
        self.reader = reader
        self.root_id = root_id
        self.printer = StreamPrinter(write, whole_lines, transitions=not whole_lines)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"text {root_id}", daemon=True)

    def _run(self) -> None:
        try:
            for event in follow(self.reader, self.root_id, stop=self._stopped.is_set):
                self.printer.show(event)
        except Exception:  # the text is a courtesy: the run goes on without it
            log.warning("the live text stopped", exc_info=True)
        finally:
            self.printer.finish()

    def start(self) -> LiveText:
        """Start printing; return self."""
        self._thread.start()
        return self

    def stop(self, ended: bool) -> None:
        """Stop: when the root ``ended``, first let the stream reach its end (2 s at most)."""
        if ended:
            self._thread.join(LIVE_TEXT_DRAIN_SECONDS)
        self._stopped.set()
        self._thread.join(LIVE_TEXT_DRAIN_SECONDS)
