"""A person's hand on a running tree: cancel, pause and resume, answers, approvals.

A part of the store (``store.steering``, :class:`Steering`). Every
change is one guarded statement of ``queries.sql`` with its ``task_events`` rows; when a
task ends here (cancelled, answered, rejected, past its question deadline), its spend is
rolled up and its parent's fan-in runs in the same transaction, exactly as for a child a
worker finished (``store.transitions.children_ended``).

- **Cancel** (``task_cancel_subtree``) ends a task and every open task below it as
  ``cancelled`` and clears their leases: a worker still running one finds every fenced
  write refused, and learns of it at its next stop check or heartbeat (``stopped``).
- **Pause** is a row in ``tree_pauses``: claims skip the tree, the model-call gate
  (``gate_calls``) holds its running tasks' next calls; ``resume`` deletes the row.
- **Questions** are tasks addressed to the built-in agent ``human`` (never claimed); an
  answer is validated against the question's ``answer_schema``/``choices`` first.
- **Approvals** release (``pending``) or reject (``failed``) a task held in
  ``awaiting_approval`` by the ``require_approval`` policy.
"""

from runtime.store.steering.commands import CANCEL_PASSES, Steering
from runtime.store.steering.types import (
    CancelOutcome,
    GateRow,
    SteeringConflict,
    SteeringRefused,
    SteerOutcome,
    validate_answer,
)

__all__ = ["CANCEL_PASSES", "CancelOutcome", "GateRow", "SteerOutcome", "Steering",
           "SteeringConflict", "SteeringRefused", "validate_answer"]
