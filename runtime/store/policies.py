"""What the wiring sets on the store from configuration: the tenants' shares and the holds.

One :class:`Policies` per store (``store.policies``), shared by the parts that read it:
the tenants' weights, caps and token rates (``[tenants.*]``, ``[scheduler]``: claims,
delegation, charges) and the ``require_approval`` holds (``[policies]``: the statements
that insert tasks). The wiring sets it after the store is built
(:func:`runtime.wiring.open_store`); the defaults hold nothing and cap nobody.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from runtime.store.rows import Tenancy


class Policies:
    """The tenancy and the require_approval holds the store's statements are given."""

    def __init__(self) -> None:
        #: ``[tenants.*]`` and ``[scheduler]``: every tenant weighs 1, none is capped.
        self.tenancy = Tenancy()
        #: Agents whose delegated tasks (and submitted roots) wait in 'awaiting_approval'.
        self.approval_agents: tuple[str, ...] = ()
        #: The tree spend past which a delegated task waits in 'awaiting_approval'.
        self.approve_above_usd: Decimal | None = None

    def approval_params(self) -> dict[str, Any]:
        """The require_approval parameters of the statements that insert tasks."""
        return {"approval_agents": list(self.approval_agents),
                "approve_above_usd": self.approve_above_usd}
