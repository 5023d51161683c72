"""The built-in rule ``require_approval``: some tasks wait for a person before they run.

Configured in ``[policies]``: ``require_approval = ["agent", ...]`` holds every task
delegated to those agents, and every root submitted (or forked) to them;
``approve_above_usd`` holds a delegated task whose budget would take its tree's spend
past the threshold. A held task waits in ``awaiting_approval`` (never
claimed) until ``orgchart approve`` (it becomes ``pending``, once) or ``orgchart reject
--note`` (it ends ``failed`` with the note, and its parent decides as for any failed
child). The hold is decided in the database, in the statement that inserts the children
(``task_delegate_running_many``), so it reads the tree's spend at that instant, and a
root's in the statement that inserts it (``task_insert_root``); this class carries the
rule's settings, its switch and its description, and :func:`holds` what every Store
opened on these settings holds.
"""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING, Any

from policies.base import Policy

if TYPE_CHECKING:
    from runtime.config import Settings


class RequireApproval(Policy):
    """Hold delegated tasks of some agents, or past a tree spend, for a person's approval."""

    name = "require_approval"
    description = ("Tasks for [policies] require_approval agents, or past approve_above_usd "
                   "of tree spend, wait for orgchart approve.")

    @classmethod
    def inactive_reason(cls, settings: Settings) -> str | None:
        """Off until an agent or a spend threshold is configured."""
        p = settings.policies
        if not p.require_approval and p.approve_above_usd is None:
            return "no [policies] require_approval agents and no approve_above_usd"
        return None

    def settings_view(self) -> dict[str, Any]:
        """``require_approval`` and ``approve_above_usd``."""
        above = self.settings.policies.approve_above_usd
        return {"require_approval": list(self.settings.policies.require_approval),
                "approve_above_usd": None if above is None else str(above)}


def holds(settings: Settings) -> tuple[tuple[str, ...], Decimal | None]:
    """``(agents, spend threshold)`` the Store holds tasks for; nothing when the rule is off.

    Off when unconfigured or named in ``[policies] disabled``. The wiring sets these on
    every Store it opens (``runtime.wiring.open_store``), so a submission from the CLI or
    the API is held as a worker's delegation is.
    """
    p = settings.policies
    if RequireApproval.name in p.disabled or RequireApproval.inactive_reason(settings):
        return (), None
    return tuple(p.require_approval), p.approve_above_usd
