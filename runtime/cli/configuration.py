"""``orgchart config``: the effective configuration, and where each value came from.

Each key is shown with its value and its origin: ``default``, the configuration file's
path, or the name of the environment variable that set it (``ORGCHART_OLLAMA__URL``,
``ORGCHART_DATABASE_URL``). ``--json`` prints ``{section: {key: value}}`` only. A database
URL is shown with its password hidden. Reads no database and no model server.
"""

from __future__ import annotations

import json
from typing import Any

from rich.markup import escape
from rich.table import Column, Table

from runtime.cli.common import JsonOpt, out, print_json, settings
from runtime.store.db import redacted, sqlalchemy_url


def _shown(section: str, key: str, value: Any) -> Any:
    if section == "database" and key == "url" and value:
        return redacted(sqlalchemy_url(value))
    return value


def config(json_: JsonOpt = False) -> None:
    """Print the effective configuration and where each value came from."""
    effective = settings()
    rows = [(section, key, _shown(section, key, value), origin)
            for section, key, value, origin in effective.explain()]
    if json_:
        sections: dict[str, dict[str, Any]] = {}
        for section, key, value, _origin in rows:
            sections.setdefault(section, {})[key] = value
        print_json(sections)
        return
    # Long values fold; the key and where it came from stay whole on their line.
    table = Table(Column("key", no_wrap=True), Column("value", overflow="fold"),
                  Column("from", no_wrap=True),
                  title=f"configuration (file: {effective.source or 'none'})",
                  title_justify="left")
    for section, key, value, origin in rows:
        table.add_row(f"{section}.{key}", escape(json.dumps(value, default=str)),
                      escape(origin), style=None if origin != "default" else "dim")
    out.print(table)
