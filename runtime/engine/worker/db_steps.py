"""A worker's blocking database steps: claim a batch, write actions, run maintenance.

The scheduler runs them in its database threads; the step API (``Worker.run_once``) calls
them in the caller's thread. Both go through this one code.

- :meth:`Steps.claim_batch` claims run-stage and judge-stage work, alternating which goes
  first; the judge's claim is skipped while nothing waits for the judge (results are
  mostly judged inline) until a ``judge`` notification or a poll says otherwise.
- :meth:`Steps.apply` writes actions: one statement for all run outcomes, one for all
  verdicts (each row guarded by status and lease token, each transition its event in the
  same statement; a row the database refuses fails alone), then the delegations (one
  transaction for all of them when it can) and the retries of children.

Failure modes: a database error propagates to the caller (the scheduler retries the
whole write; a repeated write matches no row, so nothing is written twice).
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import sqlalchemy as sa

from runtime.engine.actions import Action, DelegateAction, Dropped, RetryAction
from runtime.engine.judge_stage import undecided
from runtime.engine.maintenance import Maintenance
from runtime.engine.worker.settings import WorkerConfig, WorkerStats
from runtime.engine.worker.state import InFlight
from runtime.store.rows import Handoff, JudgeOutcome, RunOutcome
from runtime.store.store import Store

log = logging.getLogger(__name__)


class Steps:
    """Claims, writes and maintenance for one worker (blocking; see the module doc)."""

    def __init__(self, store: Store, config: WorkerConfig, stats: WorkerStats) -> None:
        self.store = store
        self.config = config
        self.stats = stats
        #: Cleared when a judge claim found less than it asked for; set by a ``judge``
        #: notification or a poll.
        self.judging_may_wait = threading.Event()
        self.judging_may_wait.set()
        self._judge_first = False
        self._claim_lock = threading.Lock()
        self.maintenance = Maintenance(store, config.retry.max_delivery,
                                       config.worker.maintenance_interval_seconds)

    # ------------------------------------------------------------------ claims
    def claim_batch(self, capacity: int) -> list[InFlight]:
        """Claim up to ``capacity`` tasks (run and judge stage, alternating priority)."""
        cfg = self.config
        if cfg.task_cap is not None:
            capacity = min(capacity, cfg.task_cap - self.stats.claimed)
        capacity = min(capacity, cfg.worker.batch_size)
        if capacity <= 0:
            return []
        with self._claim_lock:
            order = ["judge", "run"] if self._judge_first else ["run", "judge"]
            self._judge_first = not self._judge_first
        claimed: list[InFlight] = []
        for kind in order:
            room = capacity - len(claimed)
            if room <= 0:
                break
            if kind == "run" and cfg.run_agents:
                lease = cfg.worker.lease_seconds
                rows = (self.store.claims.claim(cfg.run_agents, room, cfg.worker_id, lease)
                        if cfg.root_ids is None else self.store.claims.claim_in_trees(
                            cfg.root_ids, cfg.run_agents, room, cfg.worker_id, lease))
            elif kind == "judge" and cfg.judges and self.judging_may_wait.is_set():
                rows = (self.store.claims.claim_judging(room, cfg.worker_id,
                                                        cfg.worker.lease_seconds)
                        if cfg.root_ids is None else self.store.claims.claim_in_trees(
                            cfg.root_ids, (), room, cfg.worker_id, cfg.worker.lease_seconds,
                            judging=True))
                if len(rows) < room:
                    # Nothing more waits for the judge: skip this round trip until a
                    # 'judge' notification or the next poll.
                    self.judging_may_wait.clear()
            else:
                continue
            claimed += [InFlight(row, kind) for row in rows]
        with self._claim_lock:
            self.stats.claimed += len(claimed)
        return claimed

    def count_claimed(self, n: int) -> None:
        """``n`` tasks were leased to this worker by its own writes (a hand-off)."""
        with self._claim_lock:
            self.stats.claimed += n

    # ------------------------------------------------------------------ writes
    def apply(self, actions: list[Action], handoff: Handoff | None = None) -> None:
        """Write a list of actions: batched outcomes, then delegations and retries.

        With ``handoff``, what these writes make claimable and the worker may take (a
        parent's aggregate, the children it delegated) is leased to it in the same
        transactions: the rows are in ``handoff.taken``, for the worker to run.
        """
        runs = [a for a in actions if isinstance(a, RunOutcome)]
        verdicts = [a for a in actions if isinstance(a, JudgeOutcome)]
        if runs:
            self._write_batch(runs, self.store.transitions.finish_running, handoff)
            if any(a.to_status == "judging" for a in runs):
                # Results now wait for the judge: look at its queue at the next claim,
                # not only after the 'judge' notification comes back (a --once worker
                # that claimed before it came would think the queue empty and exit).
                self.judging_may_wait.set()
        if verdicts:
            self._write_batch(verdicts, self.store.transitions.finish_judging, handoff)
        alone = {id(a) for a in self._delegate_together(
            [a for a in actions if isinstance(a, DelegateAction)], handoff)}
        for action in actions:
            if isinstance(action, DelegateAction) and id(action) in alone:
                self._delegate_one(action, handoff)
            elif isinstance(action, RetryAction):
                n = self.store.transitions.retry_children(action.task_id, action.lease_token,
                                                          action.child_ids, self.config.worker_id,
                                                          action.reassign_to, action.detail)
                self.stats.retried_children += n
            elif isinstance(action, Dropped):
                self.stats.dropped += 1
                log.warning("task dropped", extra={"task_id": str(action.task_id),
                                                   "reason": action.reason})

    def _delegate_together(self, delegations: list[DelegateAction],
                           handoff: Handoff | None = None) -> list[DelegateAction]:
        """Write several delegations in one transaction; return those left to write alone.

        A payload the database refuses fails the whole transaction: then each is written
        alone, so only the bad one fails.
        """
        if len(delegations) <= 1:
            return delegations
        try:
            done = self.store.transitions.delegate_many(
                [(d.task_id, d.lease_token, d.children, d.detail, d.stamp) for d in delegations],
                self.config.worker_id, handoff)
        except sa.exc.DataError:
            return delegations
        for applied, _ in done:
            self.stats.delegated += int(applied)
            self.stats.stale += int(not applied)
        return []

    def _delegate_one(self, action: DelegateAction, handoff: Handoff | None = None) -> None:
        try:
            applied, _ = self.store.transitions.delegate(action.task_id, action.lease_token,
                                                         action.children, self.config.worker_id,
                                                         action.detail, action.stamp, handoff)
        except sa.exc.DataError as exc:  # a child payload the database refuses
            self._write_batch([RunOutcome(
                action.task_id, action.lease_token, "failed",
                error=f"delegation could not be stored: {exc.orig}")],
                self.store.transitions.finish_running)
            return
        self.stats.delegated += int(applied)
        self.stats.stale += int(not applied)

    def _write_batch(self, outcomes: list[Any], write: Any,
                     handoff: Handoff | None = None) -> None:
        """Write a batch of outcomes in one statement (and hand up to ``handoff``).

        A row the database refuses (a NUL character in a result, say) fails alone, with
        the reason, instead of blocking the whole batch forever.
        """
        try:
            done = write(outcomes, self.config.worker_id, handoff)
        except sa.exc.DataError as exc:
            if len(outcomes) > 1:
                for outcome in outcomes:
                    self._write_batch([outcome], write, handoff)
                return
            (bad,) = outcomes
            log.warning("outcome refused by the database", extra={"task_id": str(bad.task_id)})
            reason = f"the outcome could not be stored: {exc.orig}"
            if isinstance(bad, RunOutcome):
                done = self.store.transitions.finish_running(
                    [RunOutcome(bad.task_id, bad.lease_token, "failed", error=reason)],
                    self.config.worker_id)
            else:
                done = self.store.transitions.finish_judging(
                    [JudgeOutcome(bad.task_id, bad.lease_token, "escalated", undecided(reason),
                                              error=reason)], self.config.worker_id)
        self._count(outcomes, done.applied, done.stale)

    def _count(self, outcomes: list[Any], applied: list[uuid.UUID],
               stale: list[uuid.UUID]) -> None:
        ok = set(applied)
        for o in outcomes:
            if o.task_id in ok:
                self.stats.outcomes[o.to_status] += 1
        self.stats.stale += len(stale)

    # ------------------------------------------------------------------ maintenance
    def maintain_once(self) -> bool:
        """One pass of the reaper, the watchdog and the fan-in sweeper; False when skipped.

        Skipped when another worker is running one, or ran one within
        ``maintenance_interval_seconds``.
        """
        done = self.maintenance.run_once()
        if done is None:
            return False
        self.stats.reaped += done.reaped.released
        self.stats.poisoned += done.reaped.poisoned
        self.stats.timed_out += done.timed_out.failed
        self.stats.swept += done.swept.ready
        return True
