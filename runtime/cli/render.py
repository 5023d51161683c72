"""Drawing task trees on a terminal with rich (``orgchart run``, ``orgchart tree``)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from rich.tree import Tree

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
