"""``orgchart policies``: the rules every task passes, where they come from, their settings.

Active rules first (in the order they run), then the rules known but switched off, each
with the reason (``[policies] disabled``, ``delegation_edges = false``...). ``--json``
prints :meth:`policies.loader.PolicySet.describe`. ``--agents-module M`` lists M's rules as
a worker given the same option runs them. A configuration error (unknown rule in
``disabled``, a module that cannot be imported, a bad pattern) exits 2 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from rich.markup import escape
from rich.table import Table

from runtime.cli.common import JsonOpt, ModulesOpt, out, print_json
from runtime.errors import BadInput


def _settings_text(settings: dict[str, Any]) -> str:
    lines = []
    for key, value in settings.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            lines.append(f"{key}:")
            lines += [f"  {item.get('pattern')}  ({item.get('reports')})" for item in value]
        else:
            lines.append(f"{key} = {json.dumps(value, default=str)}")
    return "\n".join(lines)


def describe_policies(modules: list[str] | None = None) -> list[dict[str, Any]]:
    """Load the configuration, the agents and the rules; return the rule descriptions.

    Args:
        modules: the ``--agents-module`` modules (their rules are active, as in a worker).

    Raises:
        ConfigError: the configuration or a rule's settings are invalid.
        ImportError: an agents or policies module cannot be imported.

    """
    from agents.loader import load_modules
    from policies.loader import load_policy_set
    from runtime.config import load_settings

    settings = load_settings()
    extra = list(modules or [])
    registry = load_modules([*settings.agents.modules, *extra])
    return load_policy_set(settings, registry, extra).describe()


def policies_table(rows: list[dict[str, Any]]) -> Table:
    """Render rule descriptions as a rich table."""
    table = Table(title="policies", title_justify="left")
    table.add_column("rule", style="bold")
    table.add_column("active")
    table.add_column("source")
    table.add_column("settings")
    table.add_column("what it checks")
    for row in rows:
        active = "yes" if row["active"] else f"no: {row.get('inactive_reason', '')}"
        cells = (row["name"], active, row["source"], _settings_text(row["settings"]),
                 row["description"])
        # Patterns and reasons hold brackets ("[policies]", "[pousr]"): never rich markup.
        table.add_row(*(escape(c) for c in cells), style=None if row["active"] else "dim")
    return table


def policies(as_json: JsonOpt = False, agents_module: ModulesOpt = None) -> None:
    """List the policy rules: active or not, source, settings."""
    try:
        rows = describe_policies(agents_module)
    except ValueError as exc:  # a rule's own settings (a bad pattern...): bad input
        raise BadInput(str(exc)) from exc
    if as_json:
        print_json(rows)
        return
    out.print(policies_table(rows))
