"""Spend: model calls charged to their own task, a running tree's live spend, tenants' tokens.

A part of the store (``store.spend``, :class:`Spend`). A model call charges only its own
task (and its ``model_calls`` row); a child's spend rolls up to its parent when the child
reaches a terminal status (:mod:`runtime.store.transitions`); a running tree's live spend is
summed from ``model_calls`` by root (:meth:`Spend.live`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from runtime.jsoncodec import dumps_fast
from runtime.store.database import Database
from runtime.store.policies import Policies
from runtime.store.queries import TEXT as _TEXT
from runtime.store.rows import ModelCharge

log = logging.getLogger(__name__)


#: How many levels a late charge of a cancelled task is rolled up at most (a tree's depth).
MAX_ROLL_UP_LEVELS = 100



def charge_record(c: ModelCharge) -> dict[str, Any]:
    """``c`` as one input row of ``task_charge_running_many`` (as the journal keeps it)."""
    return {"id": str(c.task_id), "token": str(c.lease_token),
            "tokens": c.prompt_tokens + c.completion_tokens, "usd": str(c.cost_usd),
            "route": c.route, "route_reason": c.route_reason, "model": c.model,
            "attempt": c.attempt, "call_index": c.call_index, "backend": c.backend,
            "prompt": c.prompt, "response": c.response, "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "duration_seconds": c.duration_seconds, "error": c.error, "phase": c.phase,
            "position": c.position, "request_hash": c.request_hash,
            "attempt_kind": c.attempt_kind, "call_try": c.call_try, "replayed": c.replayed,
            "thinking": c.thinking, "tool_calls": c.tool_calls}

class Spend:
    """Charging model calls (one at a time or batched) and reading a tree's live spend.

    ``store.spend``; ``policies`` is the store's :class:`~runtime.store.policies.Policies`,
    whose ``tenancy`` (set by the wiring from ``[tenants.*]``) a batch's charges are
    weighed with for the tenants' fair shares.
    """

    def __init__(self, database: Database, policies: Policies) -> None:
        self.database = database
        self.policies = policies

    def recorded(self, charges: Sequence[Any]) -> set[int]:
        """Positions in ``charges`` (``ModelCharge`` s) whose call is already recorded.

        For a batch whose COMMIT was in doubt: what landed must not be charged twice.
        """
        batch = [{"n": n, "id": str(c.task_id), "attempt": c.attempt,
                  "call_index": c.call_index, "call_try": c.call_try,
                  "attempt_kind": c.attempt_kind, "phase": c.phase, "position": c.position}
                 for n, c in enumerate(charges)]
        with self.database.connect() as conn:
            return {int(r.n) for r in conn.execute(_TEXT["model_call_find_recorded"],
                                                   {"batch": json.dumps(batch)})}

    def charge(self, charge: ModelCharge) -> bool:
        """Record one model call and charge it to its task only (one row, one insert).

        The spend reaches the ancestors when the task ends
        (:meth:`runtime.store.transitions.Transitions.children_ended`).
        Returns False (nothing written) when the task's lease is gone.
        """
        with self.database.transaction() as conn:
            row = conn.execute(
                _TEXT["task_charge_running"],
                {
                    "id": charge.task_id, "token": charge.lease_token,
                    "tokens": charge.prompt_tokens + charge.completion_tokens,
                    "usd": charge.cost_usd, "route": charge.route,
                    "route_reason": charge.route_reason, "model": charge.model,
                    "attempt": charge.attempt, "call_index": charge.call_index,
                    "backend": charge.backend, "prompt": charge.prompt,
                    "response": charge.response, "prompt_tokens": charge.prompt_tokens,
                    "completion_tokens": charge.completion_tokens,
                    "duration_seconds": charge.duration_seconds, "error": charge.error,
                    "phase": charge.phase, "position": charge.position,
                    "request_hash": charge.request_hash, "attempt_kind": charge.attempt_kind,
                    "call_try": charge.call_try, "replayed": charge.replayed,
                    "thinking": charge.thinking,
                    "tool_calls": (None if charge.tool_calls is None
                                   else dumps_fast(charge.tool_calls)),
                },
            ).first()
        if row is None:
            log.warning("late charge ignored: lease gone", extra={"task_id": str(charge.task_id)})
            return False
        return True

    def charge_many(self, charges: Sequence[ModelCharge]) -> list[bool]:
        """Charge a batch of model calls in one statement; True for each one recorded.

        Each call is guarded by its task's lease token like :meth:`charge`; several calls
        of one task add up. A batch the database refuses as a whole (a NUL byte in one
        prompt, say) is retried one call at a time, so a bad row fails alone.
        """
        if not charges:
            return []
        batch = [{"n": n, **charge_record(c)} for n, c in enumerate(charges)]
        try:
            with self.database.transaction() as conn:
                rows = conn.execute(_TEXT["task_charge_running_many"],
                                    {"batch": dumps_fast(batch),
                                     **self.policies.tenancy.charge_params()}).all()
                done = {r.n for r in rows}
                late = sorted({r.id for r in rows if r.status == "cancelled" and r.parent_id})
                if late:
                    self._roll_up_late(conn, late)
        except sa.exc.DataError:
            if len(charges) == 1:
                raise
            return [ok for c in charges for ok in self.charge_many([c])]
        for n, c in enumerate(charges):
            if n not in done:
                log.warning("late charge ignored: lease gone", extra={"task_id": str(c.task_id)})
        return [n in done for n in range(len(charges))]

    def mark_call_failed(self, charge: ModelCharge, error: str) -> bool:
        """Give the recorded row of ``charge`` its error (the reply was bad); fenced.

        The row was recorded and charged on arrival (:meth:`charge_many`); its charge
        stays. Returns False (nothing written) when the task's lease is gone.
        """
        with self.database.transaction() as conn:
            row = conn.execute(_TEXT["model_call_mark_failed"], {
                "task_id": charge.task_id, "token": charge.lease_token, "error": error,
                "attempt": charge.attempt, "call_index": charge.call_index,
                "call_try": charge.call_try, "attempt_kind": charge.attempt_kind,
                "phase": charge.phase, "position": charge.position,
                "request_hash": charge.request_hash}).first()
        if row is None:
            log.warning("late model-call error ignored: lease gone",
                        extra={"task_id": str(charge.task_id)})
            return False
        return True

    @staticmethod
    def _roll_up_late(conn: Connection, ids: list[uuid.UUID]) -> None:
        """Roll a late charge of cancelled tasks up through their finished ancestors.

        A cancelled task's spend was rolled up when it was cancelled; a call answered
        before its worker stopped may be charged after. Its difference goes to its parent,
        and on up while the parent is finished too (a cancelled subtree), each level's
        parents locked (children first, as everywhere) in the charge's transaction.
        """
        level = ids
        for _ in range(MAX_ROLL_UP_LEVELS):
            rolled = conn.execute(_TEXT["task_roll_up_children"], {"ids": level}).all()
            if not rolled:
                return
            tokens: dict[uuid.UUID, int] = {}
            usd: dict[uuid.UUID, Decimal] = {}
            for r in rolled:
                tokens[r.parent_id] = tokens.get(r.parent_id, 0) + int(r.tokens)
                usd[r.parent_id] = usd.get(r.parent_id, Decimal(0)) + Decimal(r.usd)
            level = sorted(tokens)
            conn.execute(_TEXT["task_lock_parents"], {"ids": level})
            conn.execute(_TEXT["task_add_children_spend"],
                         {"ids": level, "tokens": [tokens[i] for i in level],
                          "usd": [usd[i] for i in level]})

    def live(self, root_id: uuid.UUID) -> tuple[int, Decimal, int]:
        """``(tokens, usd, calls)`` a tree has spent so far, running tasks included."""
        with self.database.connect() as conn:
            row = conn.execute(_TEXT["model_call_spend_by_root"], {"root_id": root_id}).one()
        return int(row.tokens), Decimal(row.usd), int(row.calls)

    def take_tenant_tokens(self, tenant: str, need: float, rate: float,
                           refund: float = 0.0) -> float:
        """Take ``need`` tokens from ``tenant``'s bucket (``rate`` tokens a minute).

        ``refund`` (what settled calls reserved and did not spend) is added first, whether
        or not the tokens are taken. Returns 0 when they were taken, otherwise the seconds
        the bucket's refill needs to cover them (nothing taken: ask again then).
        One statement (two more the first time a tenant's bucket is used).
        """
        params = {"tenant": tenant, "need": need, "rate": rate, "refund": refund}
        with self.database.transaction() as conn:
            row = conn.execute(_TEXT["tenant_bucket_take"], params).first()
            if row is None:
                conn.execute(_TEXT["tenant_bucket_create"], params)
                row = conn.execute(_TEXT["tenant_bucket_take"], params).one()
        if row.taken or need <= 0:  # a refund alone never waits
            return 0.0
        return max(0.0, (need - float(row.avail)) * 60.0 / rate)
