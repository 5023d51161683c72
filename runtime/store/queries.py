"""The named SQL of ``runtime/store/queries.sql``, parsed once into ``{name: statement}``.

A block starts with ``-- name --``, then a one-line description, then the SQL
(procrastinate's ``queries.sql`` layout). Only the store executes them (and ``db.py``
its migration lock and version check).

``{tasks_channel}`` in the SQL is replaced at load time by :data:`TASKS_CHANNEL`, the
one LISTEN/NOTIFY channel: every ``pg_notify`` and the ``channel_listen_tasks``
statement name it from here (``LISTEN`` takes no bound parameter). ``{fragment_x}`` is
replaced by the block named ``fragment_x`` (a shared piece of SQL, never run alone).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, LiteralString

import sqlalchemy as sa

QUERIES_FILE = Path(__file__).with_name("queries.sql")
_BLOCK = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)

#: The LISTEN/NOTIFY channel on which new or released work is announced; the payload is
#: the agent name (``judge`` for the judge stage). Listen with ``channel_listen_tasks``.
TASKS_CHANNEL = "orgchart_tasks"
_CHANNEL_TOKEN = "{tasks_channel}"
#: The channel on which new webhook events are announced (the outbox trigger of migration
#: 0013, a test event, a redelivery); the webhook deliverers listen with
#: ``channel_listen_webhooks``. ``{webhooks_channel}`` in the SQL.
WEBHOOKS_CHANNEL = "orgchart_webhooks"
_WEBHOOKS_TOKEN = "{webhooks_channel}"
#: Blocks named ``fragment_...`` are pieces of SQL, not statements: ``{fragment_x}`` in a
#: statement is replaced by the block ``fragment_x`` at load time (one definition of,
#: say, a task's JSON shape shared by two reads).
_FRAGMENT = "fragment_"

Task = dict[str, Any]


def load_queries(path: Path = QUERIES_FILE) -> dict[str, LiteralString]:
    """Parse ``queries.sql`` into ``{name: sql}``."""
    for channel in (TASKS_CHANNEL, WEBHOOKS_CHANNEL):
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", channel):
            raise ValueError(f"channel {channel!r} is not a plain identifier")
    text = (path.read_text(encoding="utf-8").replace(_CHANNEL_TOKEN, TASKS_CHANNEL)
            .replace(_WEBHOOKS_TOKEN, WEBHOOKS_CHANNEL))
    parts = _BLOCK.split(text)
    queries: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"{path}: query {name!r} is defined twice")
        queries[name] = body.strip()  # type: ignore[assignment]
    fragments = {name: _without_comments(sql) for name, sql in queries.items()
                 if name.startswith(_FRAGMENT)}
    for _ in range(len(fragments)):  # a fragment may name another: splice them in first
        fragments = {name: _spliced(sql, fragments) for name, sql in fragments.items()}
    for name, sql in queries.items():
        sql = _spliced(sql, fragments)  # type: ignore[assignment]
        if re.search(r"\{fragment_[a-z_]+\}", sql):
            raise ValueError(f"{path}: query {name!r} names an unknown fragment")
        queries[name] = _as_sent(sql)
    return queries


def _spliced(sql: str, fragments: dict[str, str]) -> str:
    for fragment, text in fragments.items():
        sql = sql.replace("{" + fragment + "}", text)
    return sql


def _without_comments(sql: str) -> str:
    return "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))


def _as_sent(sql: str) -> str:
    """A statement as it is sent: its one-line description, then its SQL without comment lines.

    The comments are for the reader of ``queries.sql``; the description stays, so that
    ``pg_stat_statements`` and the server's logs say which statement ran. Without them the
    longest statements fit psycopg's cache of converted queries
    (:data:`MAX_SENT_CHARS`): the claim (5,550 characters with its comments) and the
    batched finish (4,985) were parsed again, by regular expression, at every execution.
    """
    head, _, rest = sql.partition("\n")
    if not head.startswith("--"):
        return _without_comments(sql)
    return head + "\n" + _without_comments(rest)


#: psycopg converts a query's placeholders once and caches the result only for queries up
#: to this length (``psycopg._queries.MAX_CACHED_STATEMENT_LENGTH``).
MAX_SENT_CHARS = 4096


QUERIES = load_queries()
TEXT = {name: sa.text(sql) for name, sql in QUERIES.items()}
