"""Claiming and holding work: claims, the judge stage's lease, heartbeats, release.

A part of the store (``store.claims``, :class:`Claims`). Tasks handed to the engine are
typed rows (:class:`~runtime.store.rows.TaskRow`, built in one place: :func:`task_rows`).
What happens to a task once it has run is :mod:`runtime.store.transitions`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy.engine import Connection

from runtime.store.database import Database
from runtime.store.policies import Policies
from runtime.store.queries import TEXT as _TEXT
from runtime.store.rows import TaskRow

#: The least time since the last maintenance pass within which a worker counts as live.
LIVE_WINDOW_SECONDS = 10.0


def task_rows(conn: Connection, name: str, /, **params: Any) -> list[TaskRow]:
    """Run a named read and type its rows (the one place tasks become ``TaskRow``)."""
    result = conn.execute(_TEXT[name], params)
    return TaskRow.from_rows(list(result.keys()), result.all())


class Claims:
    """Claims (run, aggregate, judge), children read by the engine, leases kept or handed back.

    ``store.claims``; ``policies`` is the store's
    :class:`~runtime.store.policies.Policies`, whose tenancy (set by the wiring) caps
    the tenants' claims.
    """

    def __init__(self, database: Database, policies: Policies) -> None:
        self.database = database
        self.policies = policies

    def claim(self, agents: Sequence[str], limit: int, worker: str,
              lease_seconds: float) -> list[TaskRow]:
        """Claim up to ``limit`` pending or ready-to-aggregate tasks for ``agents``."""
        if not agents or limit <= 0:
            return []
        tenants = self.policies.tenancy.claim_params()
        with self.database.transaction() as conn:
            if tenants["cap_tenants"]:
                # Capped tenants' claims take turns: each counts the others' commits.
                conn.execute(_TEXT["task_lock_tenants"], {"tenants": tenants["cap_tenants"]})
            dry = [] if not tenants["bucket_tenants"] else list(conn.execute(
                _TEXT["tenant_buckets_dry"], tenants).scalars())  # tokens_per_minute
            # Without a capped tenant, the plain claim: a third cheaper than the capped one.
            caps = ({"cap_tenants": tenants["cap_tenants"], "caps": tenants["caps"]}
                    if tenants["cap_tenants"] else {})
            return task_rows(conn, "task_claim_capped" if caps else "task_claim_available",
                                   agents=list(agents), limit=limit, worker=worker,
                                   dry_tenants=dry, lease_seconds=float(lease_seconds), **caps)

    def claim_in_trees(self, roots: Sequence[uuid.UUID], agents: Sequence[str], limit: int,
                       worker: str, lease_seconds: float, judging: bool = False
                       ) -> list[TaskRow]:
        """Claim as :meth:`claim` (or lease for the judge stage), only in ``roots``' trees.

        What ``orgchart run`` and ``orgchart.Client.run`` claim: their own tree, never a
        goal queued by someone else. Tenants' caps and dry token buckets still hold.
        """
        if not roots or limit <= 0 or (not judging and not agents):
            return []
        with self.database.transaction() as conn:
            if judging:
                return task_rows(conn, "task_claim_judging_in_trees", roots=list(roots),
                                       limit=limit, worker=worker,
                                       lease_seconds=float(lease_seconds))
            tenants = self.policies.tenancy.claim_params()
            if tenants["cap_tenants"]:
                conn.execute(_TEXT["task_lock_tenants"], {"tenants": tenants["cap_tenants"]})
            dry = [] if not tenants["bucket_tenants"] else list(conn.execute(
                _TEXT["tenant_buckets_dry"], tenants).scalars())
            return task_rows(conn, "task_claim_in_trees", roots=list(roots),
                                   agents=list(agents), limit=limit, worker=worker,
                                   dry_tenants=dry, lease_seconds=float(lease_seconds),
                                   cap_tenants=list(tenants["cap_tenants"]),
                                   caps=list(tenants["caps"]), claim_note=None)

    def no_worker_warning(self, agent: str, maintenance_interval_seconds: float
                          ) -> str | None:
        """A warning for a submitter when no live worker claims work, else None.

        Live: a worker session whose lock is held, a maintenance pass within three
        ``[worker] maintenance_interval_seconds`` (at least :data:`LIVE_WINDOW_SECONDS`),
        or a live lease (``worker_list_live_signs``). Workers do not record the agents
        they serve, so a live worker of other agents counts as live.
        """
        recent_seconds = max(LIVE_WINDOW_SECONDS, 3 * maintenance_interval_seconds)
        with self.database.connect() as conn:
            signs = conn.execute(_TEXT["worker_list_live_signs"],
                                 {"recent_seconds": float(recent_seconds)}).one()
        if signs.sessions or signs.maintained or signs.leased:
            return None
        return (f"no live worker serves agent {agent!r} (no worker session, no maintenance "
                f"pass in the last {recent_seconds:g} s, no task leased): the goal waits in "
                "the queue until one starts (orgchart worker; or orgchart run, or "
                "orgchart mcp --worker, which run one in their own process)")

    def claim_judging(self, limit: int, worker: str, lease_seconds: float) -> list[TaskRow]:
        """Lease up to ``limit`` tasks waiting for the judge stage."""
        if limit <= 0:
            return []
        with self.database.transaction() as conn:
            return task_rows(conn, "task_claim_judging", limit=limit, worker=worker,
                                   lease_seconds=float(lease_seconds))

    def child_rows(self, task_id: uuid.UUID) -> list[TaskRow]:
        """The children of one task as typed rows, in creation order (for the engine)."""
        with self.database.connect() as conn:
            return task_rows(conn, "task_list_children", id=task_id)

    def heartbeat(self, tokens: Iterable[uuid.UUID], lease_seconds: float) -> set[uuid.UUID]:
        """Extend leases; return the tokens still held (the others were taken away)."""
        tokens = list(tokens)
        if not tokens:
            return set()
        with self.database.transaction() as conn:
            rows = conn.execute(_TEXT["task_heartbeat_leased"],
                                {"tokens": tokens, "lease_seconds": float(lease_seconds)})
            return {row.lease_token for row in rows}

    def release(self, tokens: Iterable[uuid.UUID], worker: str) -> int:
        """Hand back leased tasks (a worker shutting down); returns how many."""
        tokens = list(tokens)
        if not tokens:
            return 0
        with self.database.transaction() as conn:
            return len(conn.execute(_TEXT["task_release_leased"],
                                    {"tokens": tokens, "worker": worker}).all())
