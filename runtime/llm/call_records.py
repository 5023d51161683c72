"""A model call's durable record: the ``model_calls`` rows of a task's requests.

:class:`Rows` builds each request's row (answered, failed or replayed);
:class:`HeldReplays` holds replayed calls' rows for the task's outcome, which writes
them in its own transaction (:func:`defer_replays`, :func:`held_replays`, used by the
executor).
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, TypeVar

from runtime.budget import call_cost
from runtime.llm.ledger import CallLedger
from runtime.llm.reply import ModelReply
from runtime.llm.request import CallProgress
from runtime.records import ModelCharge


@dataclass(frozen=True)
class Rows:
    """Whose ``model_calls`` rows a task's requests are: builds each row to charge."""

    task_id: uuid.UUID
    lease_token: uuid.UUID
    attempt: int
    backend: str
    phase: str
    record: bool

    def template(self, call: CallProgress, kind: str) -> ModelCharge:
        """The row of one request of ``call`` before its reply: no tokens, cost or text yet."""
        routed = call.routed
        return ModelCharge(
            task_id=self.task_id, lease_token=self.lease_token, attempt=self.attempt,
            call_index=call.request.call_index, backend=self.backend,
            route=routed.route.route, route_reason=routed.route.reason,
            model=routed.route.model, prompt=routed.stored_prompt, response=None,
            prompt_tokens=0, completion_tokens=0, duration_seconds=0.0, cost_usd=Decimal(0),
            phase=self.phase, position=call.request.position,
            request_hash=routed.request_hash, attempt_kind=kind, call_try=call.rows)

    def row(self, call: CallProgress, kind: str, reply: ModelReply | None, prompt_tokens: int,
            completion_tokens: int, duration: float, cost: Decimal,
            error: str | None) -> ModelCharge:
        """The row of one request of ``call`` (its text kept only when ``record``)."""
        return filled(self.template(call, kind), reply, prompt_tokens, completion_tokens,
                      duration, cost, error, keep_text=self.record)

    def replayed(self, call: CallProgress, reply: ModelReply) -> ModelCharge:
        """The zero-cost ``replayed`` row of a call served from the record."""
        return replace(self.row(call, "call", reply, 0, 0, 0.0, Decimal(0), None),
                       replayed=True, call_try=0)


def filled(template: ModelCharge, reply: ModelReply | None, prompt_tokens: int,
           completion_tokens: int, duration: float, cost: Decimal, error: str | None, *,
           keep_text: bool) -> ModelCharge:
    """``template`` (:meth:`Rows.template`) with its reply's figures (its text if ``keep_text``)."""
    kept = reply is not None and keep_text
    return replace(
        template, backend=reply.backend if reply is not None else template.backend,
        response=reply.text if kept and reply else None, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens, duration_seconds=duration, cost_usd=cost,
        error=error, thinking=reply.thinking if kept and reply else None,
        tool_calls=([c.as_json() for c in reply.tool_calls]
                    if reply is not None and reply.tool_calls else None))


def arrived_row(template: ModelCharge, reply: ModelReply, price: Decimal, *,
                keep_text: bool) -> ModelCharge:
    """The row of a reply that just arrived: its tokens, their cost at ``price``, no error.

    One function for the row whichever process records it (the worker's, or the
    recorder's: :mod:`runtime.engine.recorder`), so both write the same row.
    """
    cost = call_cost(reply.prompt_tokens + reply.completion_tokens, price)
    return filled(template, reply, reply.prompt_tokens, reply.completion_tokens,
                  reply.duration_seconds, cost, None, keep_text=keep_text)


def replay_record(rows: Rows, call: CallProgress, reply: ModelReply,
                  at: dt.datetime) -> dict[str, Any]:
    """A replayed call's row as JSON for the task's finishing write (``stamp["replays"]``).

    The columns of :meth:`Rows.replayed` the finishing statement does not fill itself
    (``replayed``, zero tokens and cost); ``at`` is when the call was served (the row's
    ``created_at``: the waterfall places it there, not at the finish).
    """
    kept, routed = rows.record, call.routed
    return {"attempt": rows.attempt, "call_index": call.request.call_index,
            "backend": reply.backend, "route": routed.route.route,
            "route_reason": routed.route.reason, "model": routed.route.model,
            "prompt": routed.stored_prompt,
            "response": reply.text if kept else None, "phase": rows.phase,
            "position": call.request.position, "request_hash": routed.request_hash,
            "thinking": reply.thinking if kept else None,
            "tool_calls": ([c.as_json() for c in reply.tool_calls] if reply.tool_calls
                           else None),
            "at": at.isoformat()}


class HeldReplays:
    """Replayed calls' rows held for the task's finishing write (the executor's).

    A re-run replays a call per task: a write each, at call time, made a replayed tree
    slower than a tree of no-op agents. Once :meth:`defer` is called (the executor does,
    for a run or an aggregate: :func:`defer_replays`), the rows go with the task's
    outcome instead (:func:`held_replays`), in its transaction: a delivery that dies
    before its outcome writes none, and the next delivery replays (and records) the
    calls again. Without :meth:`defer`, each row is written at call time.
    """

    def __init__(self, ledger: CallLedger, lease_lost: threading.Event) -> None:
        self._ledger = ledger
        self._lease_lost = lease_lost
        self._held: list[tuple[Rows, CallProgress, ModelReply, dt.datetime]] | None = None

    def defer(self) -> None:
        """From now on, hold the rows (:meth:`hold`) instead of writing them at once."""
        if self._held is None:
            self._held = []

    def hold(self, rows: Rows, call: CallProgress, reply: ModelReply) -> bool:
        """Hold one replayed call's row; False when rows are not held (the caller writes it).

        Only what the row is made of is kept (the row is built by :func:`held_replays`).
        """
        if self._held is None:
            return False
        self._held.append((rows, call, reply, dt.datetime.now(dt.UTC)))
        return True

    def take(self) -> list[tuple[Rows, CallProgress, ModelReply, dt.datetime]]:
        """The rows held so far (no longer held)."""
        held = self._held or []
        if self._held is not None:
            self._held = []
        return held

    def flush(self) -> None:
        """Write the held rows now (blocking): for an outcome that cannot carry them.

        Nothing is written once the lease is lost (the rows would be refused).
        """
        held = self.take()
        if not self._lease_lost.is_set():
            for rows, call, reply, _ in held:
                self._ledger.charge(rows.replayed(call, reply))


L = TypeVar("L")


def defer_replays(llm: L) -> L:
    """Make a task's model handle hold its replayed rows for its outcome; return it."""
    held = getattr(llm, "replays", None)
    if isinstance(held, HeldReplays):
        held.defer()
    return llm


def held_replays(llm: Any, carried: bool) -> list[dict[str, Any]]:
    """The replayed rows a task's outcome carries (``stamp["replays"]``).

    ``carried`` False: the outcome cannot carry them (a retry of children, a dropped
    task); they are written now instead, and none is returned.
    """
    held = getattr(llm, "replays", None)
    if not isinstance(held, HeldReplays):
        return []
    if carried:
        return [replay_record(*held_row) for held_row in held.take()]
    held.flush()
    return []
