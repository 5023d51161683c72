"""Domain constants every part may read: budget defaults, the human agent, tenants, events.

These are not configuration (no file or variable changes them): they are names and
defaults of the domain that the store (request types, the table's server defaults), the
agents' views (``agents.tasks`` re-exports the budget defaults), the CLI, the HTTP API
and the model layer share. This module imports nothing of the project, so every part may
import it (docs/architecture.md).
"""

from __future__ import annotations

from decimal import Decimal

#: Tokens a task's subtree may spend when the submitter names no budget.
DEFAULT_BUDGET_TOKENS = 50_000
#: Seconds a task may run (each delivery) when the submitter names no budget.
DEFAULT_BUDGET_SECONDS = 300
#: Dollars a task's subtree may spend when the submitter names no budget.
DEFAULT_BUDGET_USD = Decimal("1.0")
#: The agent that stands for a person (``agents.base.Human``): its tasks are questions no
#: worker claims. Defined here, which both the agents and the store read (the store's
#: SQL says ``'human'`` too).
HUMAN_AGENT = "human"

#: What a tenant's name may be: a short label (letters, digits, ``_ . -``).
TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
#: The tenant of a root submitted without one.
DEFAULT_TENANT = "default"

#: What ``[webhooks.<name>] events`` may name (a glob such as ``task.*`` names several).
WEBHOOK_EVENTS: tuple[str, ...] = ("tree.finished", "task.question", "task.awaiting_approval",
                                   "task.escalated", "task.cancelled", "fire.rollup")
