"""The one door to the database: every statement the runtime runs goes through :class:`Store`.

The statements that must be exact under concurrency live in ``runtime/store/queries.sql`` as
named blocks. Each state change is one guarded statement that also writes its
``task_events`` rows, run in one transaction; where fan-in has to follow (a child became
terminal), the parents are locked and flipped in that same transaction. A write from a
worker whose lease was taken away matches no row, changes nothing, and is logged.

Tasks handed to the engine (claims, a parent's children) are typed rows
(:class:`~runtime.store.rows.TaskRow`, built in one place: ``TaskRow.from_mapping``); the
public reads return plain dicts that :func:`runtime.views.task_json` turns into JSON.

Spend: a model call charges only its own task (and its ``model_calls`` row). A child's
spend rolls up to its parent when the child reaches a terminal status, in the transaction
that already locks the parent for fan-in; a running tree's live spend is summed from
``model_calls`` by root (:meth:`~runtime.store.spend.Spend.live`).
"""

from __future__ import annotations

from sqlalchemy.engine import Engine

from runtime.store.call_text import CallText
from runtime.store.claims import Claims
from runtime.store.database import Database
from runtime.store.experiments import Experiments
from runtime.store.fires import Fires
from runtime.store.hygiene import MAINTENANCE_LOCK_KEY, Hygiene, Maintained
from runtime.store.policies import Policies
from runtime.store.queries import TEXT as _TEXT
from runtime.store.reads import Reads
from runtime.store.schedules import Schedules
from runtime.store.spend import Spend
from runtime.store.steering import Steering
from runtime.store.steps import Steps
from runtime.store.streams import StreamReader
from runtime.store.tasks import Tasks
from runtime.store.transitions import Transitions
from runtime.store.webhooks import Webhooks

__all__ = ["MAINTENANCE_LOCK_KEY", "Maintained", "Store"]


class Store:
    """The database door: named statements, one transaction per state change.

    Composed of parts, one per concern, each in a module named for it and each taking
    the shared :class:`~runtime.store.database.Database` (``store.database``: the engine,
    the one transaction helper, the named statements). No part inherits another: a part
    that needs another is handed it in its constructor, and the parts that weigh tenants
    or hold tasks for approval share ``store.policies``
    (:class:`~runtime.store.policies.Policies`, set by the wiring).

    Where does a task's status change? In ``store.transitions``
    (:class:`~runtime.store.transitions.Transitions`): a run's or a verdict's outcome, a
    delegation, an aggregate's retry of children, an escalation resolved, and fan-in (a
    parent woken by its last child), which every other ending runs through. A task's
    life, part by part:

    - ``store.tasks`` (:class:`~runtime.store.tasks.Tasks`): it begins (submitted, many
      at once, a fork's branch root; a root's parameters);
    - ``store.claims`` (:class:`~runtime.store.claims.Claims`): it is leased (claims,
      the judge stage's lease, heartbeats, release);
    - ``store.transitions``: it changes status after its claim, and its parent hears;
    - ``store.reads`` (:class:`~runtime.store.reads.Reads`): tasks, trees, events,
      metrics read; finished trees pruned; the trace exporter's cursors;
    - ``store.steering`` (:class:`~runtime.store.steering.Steering`): a person's hand on
      a running tree (cancel, pause, answers, approvals) and the model-call gate;
    - ``store.hygiene`` (:class:`~runtime.store.hygiene.Hygiene`): the reaper, the
      watchdog, the sweeper, session locks.

    And beside it: ``store.spend`` (model calls charged, live spend, tenants' token
    buckets; :class:`~runtime.store.spend.Spend`), ``store.steps`` (durable steps and
    tool approvals; :class:`~runtime.store.steps.Steps`), ``store.schedules``
    (:class:`~runtime.store.schedules.Schedules`), ``store.experiments``
    (:class:`~runtime.store.experiments.Experiments`), ``store.webhooks``
    (:class:`~runtime.store.webhooks.Webhooks`), ``store.fires`` (the orchestrator's
    fires, its lock, the events it counts; :class:`~runtime.store.fires.Fires`),
    ``store.call_text`` (model calls' text written as it streams;
    :class:`~runtime.store.call_text.CallText`) and ``store.streams`` (a tree's stream
    of text and transitions read; :class:`~runtime.store.streams.StreamReader`).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        #: The engine, the one transaction helper, the named statements: every part's.
        self.database = Database(engine)
        #: The tenancy and the require_approval holds, set by the wiring.
        self.policies = Policies()
        #: Where a task begins: submitted roots, a fork's branch root, their parameters.
        self.tasks = Tasks(self.database, self.policies)
        #: Claims, the judge stage's lease, heartbeats, release.
        self.claims = Claims(self.database, self.policies)
        #: Where a task's status changes after its claim: outcomes, resolutions, fan-in.
        self.transitions = Transitions(self.database, self.policies)
        #: Tasks, trees, events and metrics read; pruning; the exporter's cursors.
        self.reads = Reads(self.database)
        #: Webhook endpoints and the outbox's deliveries.
        self.webhooks = Webhooks(self.database)
        #: Stored schedules and the ticks' transactions.
        self.schedules = Schedules(self.database, self.tasks)
        #: Datasets, experiments, their trees and their scores.
        self.experiments = Experiments(self.database, self.tasks)
        #: A person's hand on a running tree: cancel, pause, answers, approvals; the gate.
        self.steering = Steering(self.database, self.transitions)
        #: Durable steps: begin, finish, replays from a counterpart; tool approvals.
        self.steps = Steps(self.database)
        #: Model calls charged to their task, a tree's live spend, tenants' token buckets.
        self.spend = Spend(self.database, self.policies)
        #: Maintenance: the reaper, the watchdog, the sweeper; session locks.
        self.hygiene = Hygiene(self.database, self.transitions)
        #: The orchestrator's fires, the fire lock, the event counts of a fire's rollup.
        self.fires = Fires(self.database)
        #: Model calls' text written in pieces as it streams, and read back.
        self.call_text = CallText(self.database)
        #: A tree's stream read: its calls' text and its transitions, in one order.
        self.streams = StreamReader(self.database)

    # ------------------------------------------------------------------ plumbing
    def ping(self) -> bool:
        """True when the database answers (health checks); raises on connection errors."""
        with self.engine.connect() as conn:
            return conn.execute(_TEXT["db_ping"]).scalar() == 1

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()
