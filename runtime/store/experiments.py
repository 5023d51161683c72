"""The store's side of experiments: datasets, experiments, their trees and their scores.

An experiment's tree is recorded (``experiment_runs``) in the transaction that inserts its
root: a root never exists without its run row, and a run row never names a root that was
rolled back. Two processes resuming the same experiment race on the run row's primary key;
the loser rolls its root back and uses the winner's (:class:`RunTaken`).

A part of the store (``store.experiments``, :class:`Experiments`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from runtime.store.database import Database
from runtime.store.queries import TEXT as _TEXT
from runtime.store.queries import Task
from runtime.store.rows import NewBranch, NewTask, canonical_json
from runtime.store.tasks import Tasks

_rows = Database.rows


class _RunTaken(Exception):
    """Another process recorded this run first: roll this root back."""

    def __init__(self, root_id: uuid.UUID) -> None:
        super().__init__(str(root_id))
        self.root_id = root_id


class Experiments:
    """Datasets, experiments, their runs and scores (migration 0015): ``store.experiments``.

    ``tasks`` is the store's :class:`~runtime.store.tasks.Tasks`, whose ``root_params``
    and ``fork_params`` a run's root is inserted with (the same parameters as a submitted
    root or a fork's branch).
    """

    def __init__(self, database: Database, tasks: Tasks) -> None:
        self.database = database
        self.tasks = tasks

    def dataset_put(self, name: str, version: str, source: str | None,
                    cases: Sequence[dict[str, Any]]) -> tuple[uuid.UUID, bool]:
        """Store a dataset version with its cases unless it is there; ``(id, created)``."""
        with self.database.transaction() as conn:
            row = _rows(conn, "dataset_insert", dataset_name=name, version=version,
                        cases=len(cases), source=source)[0]
            if row["created"]:
                conn.execute(_TEXT["dataset_case_insert_many"],
                             {"dataset_id": row["id"], "cases": canonical_json(list(cases))})
        return row["id"], bool(row["created"])

    def dataset_get(self, name: str, version: str | None = None) -> Task | None:
        """A dataset by name (its newest version, or ``version``), or None."""
        rows = self.database.query("dataset_get_latest", dataset_name=name, version=version)
        return rows[0] if rows else None

    def dataset_cases(self, dataset_id: uuid.UUID) -> list[dict[str, Any]]:
        """A dataset's cases, in order."""
        return [row["body"] for row in self.database.query("dataset_case_list",
                                                           dataset_id=dataset_id)]

    def datasets(self) -> list[Task]:
        """Every dataset version, newest first per name."""
        return self.database.query("dataset_list")

    def create(self, name: str, dataset_id: uuid.UUID, variants: list[dict[str, Any]],
               repeat: int, budget_usd: Decimal | None, tenant: str,
               agents_modules: list[str]) -> Task | None:
        """A new experiment, or None when the name is taken."""
        with self.database.transaction() as conn:
            rows = _rows(conn, "experiment_insert", experiment_name=name,
                         dataset_id=dataset_id, variants=canonical_json(variants),
                         repeat=repeat, budget_usd=budget_usd, tenant=tenant,
                         agents_modules=canonical_json(agents_modules))
        return rows[0] if rows else None

    def get(self, key: str) -> Task | None:
        """An experiment by name or id, or None."""
        rows = self.database.query("experiment_get", key=key)
        return rows[0] if rows else None

    def all(self) -> list[Task]:
        """Every experiment, newest first."""
        return self.database.query("experiment_list")

    def set_status(self, experiment_id: uuid.UUID, status: str,
                   note: str | None = None) -> None:
        """Mark an experiment ``running``, ``finished`` or ``stopped`` (with a note)."""
        with self.database.transaction() as conn:
            _rows(conn, "experiment_set_status", id=experiment_id, status=status, note=note)

    def run_root(self, experiment_id: uuid.UUID, position: int, variant: str,
                 repetition: int) -> uuid.UUID | None:
        """The tree recorded for one (case, variant, repetition), or None."""
        rows = self.database.query("experiment_run_get", experiment_id=experiment_id,
                                   position=position, variant=variant,
                                   repetition=repetition)
        return rows[0]["root_id"] if rows else None

    def start(self, experiment_id: uuid.UUID, position: int, variant: str,
              repetition: int, *, new: NewTask | None = None,
              branch: NewBranch | None = None, actor: str = "experiment",
              ) -> tuple[uuid.UUID, bool]:
        """Insert a run's root (a new tree, or a fork's branch) with its run row.

        Returns ``(root_id, started)``; ``started`` is False when the run was recorded
        already (by an earlier, killed run of the experiment, or by a process beside
        this one), and nothing is inserted.
        """
        if (new is None) == (branch is None):
            raise ValueError("start takes a new tree or a branch, not both")
        recorded = self.run_root(experiment_id, position, variant, repetition)
        if recorded is not None:
            return recorded, False
        try:
            with self.database.transaction() as conn:
                if new is not None:
                    params = self.tasks.root_params(new, actor, uuid.uuid4())
                    root = _rows(conn, "task_insert_root", **params)
                else:
                    assert branch is not None
                    params = self.tasks.fork_params(branch, actor)
                    root = _rows(conn, "task_insert_fork_root", **params)
                if not root:  # an idempotency key seen before: experiments never set one
                    raise RuntimeError("the experiment's root was not inserted")
                root_id = root[0]["id"]
                taken = _rows(conn, "experiment_run_insert", experiment_id=experiment_id,
                              position=position, variant=variant,
                              repetition=repetition, root_id=root_id)
                if not taken:
                    raise _RunTaken(root_id)
        except _RunTaken:
            winner = self.run_root(experiment_id, position, variant, repetition)
            assert winner is not None
            return winner, False
        return root_id, True

    def runs(self, experiment_id: uuid.UUID) -> list[Task]:
        """An experiment's trees with their outcomes and their calls paid and replayed."""
        return self.database.query("experiment_run_list", experiment_id=experiment_id)

    def task_replayed_seconds(self, experiment_id: uuid.UUID) -> list[Task]:
        """Each task of an experiment's trees, with what its replayed calls took when made.

        Rows: ``root_id``, ``id``, ``parent_id``, ``replayed_seconds`` (the recorded
        durations of its calls replayed from the tree it was forked from).
        """
        return self.database.query("experiment_task_replayed_seconds", experiment_id=experiment_id)

    def open_roots(self, experiment_id: uuid.UUID) -> set[uuid.UUID]:
        """The roots of the experiment's trees that have not ended."""
        rows = self.database.query("experiment_run_list_open", experiment_id=experiment_id)
        return {row["root_id"] for row in rows}

    def spend(self, experiment_id: uuid.UUID) -> Decimal:
        """What an experiment's trees have paid so far."""
        spent = self.database.query("experiment_spend", experiment_id=experiment_id)
        return Decimal(spent[0]["spent"])

    def put_scores(self, experiment_id: uuid.UUID, scores: Sequence[dict[str, Any]]) -> None:
        """Write (or replace) score rows: position, variant, repetition, scorer, value."""
        if not scores:
            return
        with self.database.transaction() as conn:
            conn.execute(_TEXT["experiment_score_upsert_many"],
                         {"experiment_id": experiment_id,
                          "scores": canonical_json(list(scores))})

    def scores(self, experiment_id: uuid.UUID) -> list[Task]:
        """An experiment's score rows."""
        return self.database.query("experiment_score_list", experiment_id=experiment_id)

    def delete(self, experiment_id: uuid.UUID) -> bool:
        """Remove an experiment, its runs and its scores (never its trees)."""
        with self.database.transaction() as conn:
            return bool(_rows(conn, "experiment_delete", id=experiment_id))
