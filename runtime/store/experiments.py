"""The store's side of experiments: datasets, experiments, their trees and their scores.

An experiment's tree is recorded (``experiment_runs``) in the transaction that inserts its
root: a root never exists without its run row, and a run row never names a root that was
rolled back. Two processes resuming the same experiment race on the run row's primary key;
the loser rolls its root back and uses the winner's (:class:`RunTaken`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from runtime.store.queries import TEXT as _TEXT
from runtime.store.queries import Task
from runtime.store.reads import StoreReads
from runtime.store.rows import NewBranch, NewTask, canonical_json


class _RunTaken(Exception):
    """Another process recorded this run first: roll this root back."""

    def __init__(self, root_id: uuid.UUID) -> None:
        super().__init__(str(root_id))
        self.root_id = root_id


class StoreExperiments(StoreReads):
    """Datasets, experiments, their runs and scores (migration 0015)."""

    def dataset_put(self, name: str, version: str, source: str | None,
                    cases: Sequence[dict[str, Any]]) -> tuple[uuid.UUID, bool]:
        """Store a dataset version with its cases unless it is there; ``(id, created)``."""
        with self.transaction() as conn:
            row = self._rows(conn, "dataset_insert", dataset_name=name, version=version,
                             cases=len(cases), source=source)[0]
            if row["created"]:
                conn.execute(_TEXT["dataset_case_insert_many"],
                             {"dataset_id": row["id"], "cases": canonical_json(list(cases))})
        return row["id"], bool(row["created"])

    def dataset_get(self, name: str, version: str | None = None) -> Task | None:
        """A dataset by name (its newest version, or ``version``), or None."""
        rows = self.query("dataset_get_latest", dataset_name=name, version=version)
        return rows[0] if rows else None

    def dataset_cases(self, dataset_id: uuid.UUID) -> list[dict[str, Any]]:
        """A dataset's cases, in order."""
        return [row["body"] for row in self.query("dataset_case_list", dataset_id=dataset_id)]

    def dataset_list(self) -> list[Task]:
        """Every dataset version, newest first per name."""
        return self.query("dataset_list")

    def experiment_create(self, name: str, dataset_id: uuid.UUID,
                          variants: list[dict[str, Any]], repeat: int,
                          budget_usd: Decimal | None, tenant: str,
                          agents_modules: list[str]) -> Task | None:
        """A new experiment, or None when the name is taken."""
        with self.transaction() as conn:
            rows = self._rows(conn, "experiment_insert", experiment_name=name,
                              dataset_id=dataset_id, variants=canonical_json(variants),
                              repeat=repeat,
                              budget_usd=budget_usd, tenant=tenant,
                              agents_modules=canonical_json(agents_modules))
        return rows[0] if rows else None

    def experiment_get(self, key: str) -> Task | None:
        """An experiment by name or id, or None."""
        rows = self.query("experiment_get", key=key)
        return rows[0] if rows else None

    def experiment_list(self) -> list[Task]:
        """Every experiment, newest first."""
        return self.query("experiment_list")

    def experiment_set_status(self, experiment_id: uuid.UUID, status: str,
                              note: str | None = None) -> None:
        """Mark an experiment ``running``, ``finished`` or ``stopped`` (with a note)."""
        with self.transaction() as conn:
            self._rows(conn, "experiment_set_status", id=experiment_id, status=status,
                       note=note)

    def experiment_run_root(self, experiment_id: uuid.UUID, position: int, variant: str,
                            repetition: int) -> uuid.UUID | None:
        """The tree recorded for one (case, variant, repetition), or None."""
        rows = self.query("experiment_run_get", experiment_id=experiment_id,
                          position=position, variant=variant, repetition=repetition)
        return rows[0]["root_id"] if rows else None

    def experiment_start(self, experiment_id: uuid.UUID, position: int, variant: str,
                         repetition: int, *, new: NewTask | None = None,
                         branch: NewBranch | None = None, actor: str = "experiment",
                         ) -> tuple[uuid.UUID, bool]:
        """Insert a run's root (a new tree, or a fork's branch) with its run row.

        Returns ``(root_id, started)``; ``started`` is False when the run was recorded
        already (by an earlier, killed run of the experiment, or by a process beside
        this one), and nothing is inserted.
        """
        if (new is None) == (branch is None):
            raise ValueError("experiment_start takes a new tree or a branch, not both")
        recorded = self.experiment_run_root(experiment_id, position, variant, repetition)
        if recorded is not None:
            return recorded, False
        try:
            with self.transaction() as conn:
                if new is not None:
                    params = self.root_params(new, actor, uuid.uuid4())  # type: ignore[attr-defined]
                    root = self._rows(conn, "task_insert_root", **params)
                else:
                    assert branch is not None
                    params = self.fork_params(branch, actor)  # type: ignore[attr-defined]
                    root = self._rows(conn, "task_insert_fork_root", **params)
                if not root:  # an idempotency key seen before: experiments never set one
                    raise RuntimeError("the experiment's root was not inserted")
                root_id = root[0]["id"]
                taken = self._rows(conn, "experiment_run_insert", experiment_id=experiment_id,
                                   position=position, variant=variant,
                                   repetition=repetition, root_id=root_id)
                if not taken:
                    raise _RunTaken(root_id)
        except _RunTaken:
            winner = self.experiment_run_root(experiment_id, position, variant, repetition)
            assert winner is not None
            return winner, False
        return root_id, True

    def experiment_runs(self, experiment_id: uuid.UUID) -> list[Task]:
        """An experiment's trees with their outcomes and their calls paid and replayed."""
        return self.query("experiment_run_list", experiment_id=experiment_id)

    def experiment_task_replayed_seconds(self, experiment_id: uuid.UUID) -> list[Task]:
        """Each task of an experiment's trees, with what its replayed calls took when made.

        Rows: ``root_id``, ``id``, ``parent_id``, ``replayed_seconds`` (the recorded
        durations of its calls replayed from the tree it was forked from).
        """
        return self.query("experiment_task_replayed_seconds", experiment_id=experiment_id)

    def experiment_open_roots(self, experiment_id: uuid.UUID) -> set[uuid.UUID]:
        """The roots of the experiment's trees that have not ended."""
        return {row["root_id"] for row in self.query("experiment_run_list_open",
                                                     experiment_id=experiment_id)}

    def experiment_spend(self, experiment_id: uuid.UUID) -> Decimal:
        """What an experiment's trees have paid so far."""
        return Decimal(self.query("experiment_spend", experiment_id=experiment_id)[0]["spent"])

    def experiment_scores_put(self, experiment_id: uuid.UUID,
                              scores: Sequence[dict[str, Any]]) -> None:
        """Write (or replace) score rows: position, variant, repetition, scorer, value."""
        if not scores:
            return
        with self.transaction() as conn:
            conn.execute(_TEXT["experiment_score_upsert_many"],
                         {"experiment_id": experiment_id,
                          "scores": canonical_json(list(scores))})

    def experiment_scores(self, experiment_id: uuid.UUID) -> list[Task]:
        """An experiment's score rows."""
        return self.query("experiment_score_list", experiment_id=experiment_id)

    def experiment_delete(self, experiment_id: uuid.UUID) -> bool:
        """Remove an experiment, its runs and its scores (never its trees)."""
        with self.transaction() as conn:
            return bool(self._rows(conn, "experiment_delete", id=experiment_id))
