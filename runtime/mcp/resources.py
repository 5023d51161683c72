"""The MCP resources, ``orgchart://trees/{root_id}`` and ``orgchart://tasks/{id}``.

A tree reads as ``GET /trees/{root_id}`` (the full shape) plus ``streaming``: the text so
far of each running task's newest model call (``call_text_running``); a task as
``GET /tasks/{id}`` (without its model calls). A client that subscribes to one
(``resources/subscribe``, or a ``subscriptions/listen`` stream naming it) hears
``notifications/resources/updated`` each time it changes: :class:`Watcher` polls the
subscribed resources every :data:`POLL_SECONDS` on the tree's change feed
(``task_tree_changes``: one indexed read per tree's tasks, whatever the size of the
events table) and, for a tree, its newest piece of streamed text (``call_text_newest``:
one row off the ``(root_id, txid, id)`` index), and tells each subscriber once per poll
that saw a change, however many transitions and pieces it folds together: a tree whose
calls stream gets at most one update per :data:`POLL_SECONDS` (five of the default
``[streaming] flush_seconds`` windows), not one per piece.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from mcp.shared.exceptions import MCPError

from runtime.store.rows import NotFound
from runtime.store.store import Store
from runtime.views import task_detail_json, tree_text

log = logging.getLogger(__name__)

TREE_TEMPLATE = "orgchart://trees/{root_id}"
TASK_TEMPLATE = "orgchart://tasks/{id}"
#: How often the watcher reads the subscribed resources' change feeds.
POLL_SECONDS = 0.5
#: JSON-RPC's "invalid params", what the spec answers for an unknown resource.
INVALID_PARAMS = -32602
_URI = re.compile(r"^orgchart://(trees|tasks)/([^/?#]+)$")


def parse_uri(uri: str) -> tuple[str, uuid.UUID]:
    """``("trees" | "tasks", id)`` for one of our resource URIs.

    Raises:
        MCPError: the URI is not one of the two templates, or its id is not a UUID.

    """
    match = _URI.match(uri)
    if match is None:
        raise MCPError(INVALID_PARAMS, f"unknown resource {uri!r}: expected "
                                       f"{TREE_TEMPLATE} or {TASK_TEMPLATE}")
    try:
        return match.group(1), uuid.UUID(match.group(2))
    except ValueError:
        raise MCPError(INVALID_PARAMS, f"{match.group(2)!r} in {uri!r} is not a UUID") from None


def read(store: Store, uri: str) -> str:
    """The resource at ``uri`` as JSON text (blocking).

    Raises:
        MCPError: an unknown URI, or no such tree or task.

    """
    kind, ident = parse_uri(uri)
    try:
        if kind == "trees":
            tree = json.loads(tree_text(store, ident)[0])
            tree["streaming"] = store.call_text.running(ident)
            return json.dumps(tree, default=str)
        return json.dumps(task_detail_json(store, ident, model_calls=False), default=str)
    except NotFound as exc:
        raise MCPError(INVALID_PARAMS, str(exc)) from None


def version(store: Store, uri: str, after: int) -> int:
    """The newest change of the resource at ``uri`` after event ``after`` (blocking).

    A tree changes with any transition of its tasks; a task with its own. Returns
    ``after`` when nothing changed, -1 when the resource does not exist.
    """
    kind, ident = parse_uri(uri)
    try:
        row = store.reads.get(ident)
    except NotFound:
        return -1
    changes = store.reads.tree_changes(row["root_id"] or ident, after, limit=10_000)
    if kind == "tasks":
        changes = [c for c in changes if c["task_id"] == ident]
    return int(changes[-1]["id"]) if changes else after


def text_version(store: Store, uri: str) -> tuple[int, int] | None:
    """``(txid, id)`` of the newest piece of streamed text of a tree resource (blocking).

    None for a task resource (its JSON has no text) and for a tree with no text yet.
    """
    kind, ident = parse_uri(uri)
    return store.call_text.newest(ident) if kind == "trees" else None


#: Tells one subscriber that ``uri`` changed; raises when the subscriber has gone.
Notify = Callable[[str], Awaitable[None]]


@dataclass
class Watched:
    """One subscribed resource: who listens, and the last change they were told of.

    ``cursor``: the newest transition told of; ``text``: the newest piece of streamed
    text seen (a tree's; None: none yet, or a task).
    """

    cursor: int = 0
    listeners: dict[object, Notify] = field(default_factory=dict)
    text: tuple[int, int] | None = None


def _changed(store: Store, uri: str, watched: Watched) -> bool:
    """Read the resource's newest transition and text; move ``watched`` on; True if moved."""
    newest = version(store, uri, watched.cursor)
    text = text_version(store, uri)
    moved = newest > watched.cursor or (text is not None and text != watched.text)
    watched.cursor = max(watched.cursor, newest)
    watched.text = text if text is not None else watched.text
    return moved


class Watcher:
    """Polls the subscribed resources and tells their subscribers what changed."""

    def __init__(self, store: Store, interval: float = POLL_SECONDS) -> None:
        self.store = store
        self.interval = interval
        self.watched: dict[str, Watched] = {}

    async def add(self, uri: str, key: object, notify: Notify) -> None:
        """Subscribe ``key`` to ``uri`` from now on (the resource must exist).

        Raises:
            MCPError: an unknown URI or resource.

        """
        watched = self.watched.get(uri)
        if watched is None:
            cursor = await anyio.to_thread.run_sync(version, self.store, uri, 0)
            if cursor < 0:
                parse_uri(uri)
                raise MCPError(INVALID_PARAMS, f"no task {uri.rsplit('/', 1)[-1]}")
            text = await anyio.to_thread.run_sync(text_version, self.store, uri)
            watched = self.watched.setdefault(uri, Watched(cursor, text=text))
        watched.listeners[key] = notify

    def remove(self, uri: str, key: object) -> None:
        """Unsubscribe ``key`` from ``uri`` (nothing when it was not subscribed)."""
        watched = self.watched.get(uri)
        if watched is not None:
            watched.listeners.pop(key, None)
            if not watched.listeners:
                self.watched.pop(uri, None)

    async def run(self) -> None:
        """Poll until cancelled (the server's lifespan owns this task)."""
        while True:
            await anyio.sleep(self.interval)
            for uri, watched in list(self.watched.items()):
                try:
                    moved = await anyio.to_thread.run_sync(_changed, self.store, uri, watched)
                except Exception:  # a database outage: try again on the next poll
                    log.warning("could not read changes of %s", uri, exc_info=True)
                    continue
                if moved:
                    await self._tell(uri, watched)

    async def _tell(self, uri: str, watched: Watched) -> None:
        for key, notify in list(watched.listeners.items()):
            try:
                await notify(uri)
            except Exception:  # the subscriber's connection has gone: forget it
                log.info("dropping a subscriber of %s", uri, exc_info=True)
                self.remove(uri, key)


def templates() -> list[dict[str, Any]]:
    """The resource templates, as ``resources/templates/list`` lists them."""
    return [
        {"uri_template": TREE_TEMPLATE, "name": "tree", "mime_type": "application/json",
         "description": "A task tree under its root, nested, with totals (GET /trees/{id}), "
                        "and the text so far of its running tasks' model calls (streaming)."},
        {"uri_template": TASK_TEMPLATE, "name": "task", "mime_type": "application/json",
         "description": "One task with its history and children (GET /tasks/{id})."},
    ]
