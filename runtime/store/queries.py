"""The named SQL of ``runtime/store/queries.sql``, parsed once into ``{name: statement}``.

A block starts with ``-- name --``, then a one-line description, then the SQL
(procrastinate's ``queries.sql`` layout). Only the store executes them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, LiteralString

import sqlalchemy as sa

QUERIES_FILE = Path(__file__).with_name("queries.sql")
_BLOCK = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)

Task = dict[str, Any]


def load_queries(path: Path = QUERIES_FILE) -> dict[str, LiteralString]:
    """Parse ``queries.sql`` into ``{name: sql}``."""
    text = path.read_text(encoding="utf-8")
    parts = _BLOCK.split(text)
    queries: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"{path}: query {name!r} is defined twice")
        queries[name] = body.strip()  # type: ignore[assignment]
    return queries


QUERIES = load_queries()
TEXT = {name: sa.text(sql) for name, sql in QUERIES.items()}
