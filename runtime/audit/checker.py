"""The checker: every promise on every batch of trees, and a history's client promises.

:func:`audit` is what ``orgchart audit`` and the fault tests run. It reads through the
store only, in read-only transactions (:mod:`runtime.audit.facts`), and never writes.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from pathlib import Path

from runtime.audit import budgets, clients, effects, facts, paths
from runtime.audit.history import History, load
from runtime.audit.report import Report
from runtime.store.store import Store

#: How far apart two clocks' readings of one moment may be: an event's or a charge's time
#: is its transaction's start, a client's is when it was told.
SLACK_SECONDS = 1.0


def audit(store: Store, roots: Sequence[uuid.UUID] | None = None,
          since: dt.datetime | None = None, history: History | Path | str | None = None,
          slack: float = SLACK_SECONDS, batch: int = facts.BATCH_ROOTS,
          page: int = facts.PAGE_ROWS) -> Report:
    """Check the trees (all, ``roots``, or those since ``since``) and a history.

    Args:
        store: the database to read (never written).
        roots: only these trees (None: every tree).
        since: only trees whose root was created at or after this moment.
        history: a history (or its file): what clients were told, and the faults.
        slack: seconds allowed between clocks (see :data:`SLACK_SECONDS`).
        batch: trees per read-only transaction.
        page: rows per read.

    Returns:
        The report: every violation with its evidence, and what was checked.

    """
    if history is not None and not isinstance(history, History):
        history = load(history)
    report = Report()
    if history is not None:
        report.checked["faults"] = len(history.faults)
        keys, ids = clients.submit_lookups(history)
        by_key, by_id = facts.lookup(store, keys, ids)
        clients.check_submits(history, by_key, by_id, report)
        clients.check_outside(history, slack, report)
        # Pauses and resumes are checked per tree (effects.check_steering): counted once here.
        report.checked["operations"] += len(history.of("pause", "resume"))
    for trees in facts.tree_batches(store, roots, since, batch, page):
        report.checked["trees"] += sum(1 for t in trees.tasks.values() if t["parent_id"] is None)
        paths.check_paths(trees, report)
        effects.check_steering(trees, history, slack, report)
        effects.check_duplicates(trees, history, slack, report)
        effects.check_fenced_charges(trees, slack, report)
        budgets.check_budgets(trees, report)
        if history is not None:
            clients.check_answers(trees, history, report)
            clients.check_cancel_acks(trees, history, slack, report)
    return report
