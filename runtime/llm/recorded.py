"""The record look-up stage: a durable call answered before is served from its record.

A call's identity is its task, its phase (run, aggregate, judge), its position (order of
issue, or ``key=``) and the sha256 of its request (model, messages, schema, options,
tools). When the record holds a successful reply for that identity (an earlier delivery
made the call; for a fork's branch task, its counterpart did), the reply is returned at
once, charged zero, and a row marked ``replayed`` is written (``[llm] durable``; with
the task's outcome when the executor defers it: :class:`runtime.llm.call_records.HeldReplays`).
A record that no longer fits the call's schema is not served: the call is made again.
A branch task's claim carries its counterpart's replies (``counterpart_calls``): with
none of its own on record, its calls are matched against those without a look-up.

A delivery that runs a task again (``delivery_count`` above 1) first adopts the replies
its earlier deliveries' recorder journaled on arrival but never charged (the recorder
died with the worker: :mod:`runtime.store.call_replies`), once per task and batched with
the other tasks' adoptions, before its first look-up: those replies are then on record
and served like any other.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from agents.replies import Completion
from runtime.config import Settings
from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.call_records import HeldReplays
from runtime.llm.charging import Charger
from runtime.llm.completion import answered
from runtime.llm.ledger import RecordReader
from runtime.llm.reply import BadModelReply, ModelReply, parse_structured, request_text
from runtime.llm.request import CallProgress, Request
from runtime.llm.routing import Route, Routed
from runtime.llm.tool_loop import recorded_tool_calls, round_note
from runtime.records import RecordedCall

log = logging.getLogger(__name__)


class RecordedReplies:
    """Serves one task's calls from the record of replies, when it holds them.

    Args:
        settings: ``[llm] durable`` and ``record`` (both needed), ``[models]``.
        reader: the batched look-ups of recorded replies.
        task_row: the task (its id, phase, ``forked_from`` and ``model_override``,
            ``recorded_calls``: whether any reply of this phase is on record;
            ``counterpart_calls``: a branch task's counterpart's replies, from its claim).
        phase: the phase the task's calls belong to.
        charger / replays: where a replayed row is written, or held for the outcome.
        offline: the backend is offline (a replayed answer is not a model's work either).
        served: the model the backend runs on every route (the embedded model), if any:
            its calls were recorded under it.

    """

    def __init__(self, settings: Settings, reader: RecordReader, task_row: dict[str, object],
                 phase: str, charger: Charger, replays: HeldReplays, offline: bool, *,
                 served: str | None = None) -> None:
        self._settings = settings
        self._served = served
        self._reader = reader
        self._charger = charger
        self._replays = replays
        self._offline = offline
        self._task_id = charger.rows.task_id
        self._phase = phase
        #: A fork's branch: its counterpart's record answers the calls it repeats.
        counterpart = task_row.get("forked_from")
        self.counterpart = counterpart if isinstance(counterpart, uuid.UUID) else None
        override = task_row.get("model_override")
        self.model_override = str(override) if override else None
        # A delivery after the first adopts its predecessors' journaled replies, then
        # looks up the record: the claim's recorded_calls does not see the journal.
        self._adoption: asyncio.Future[None] | None = None
        deliveries = task_row.get("delivery_count")
        self._adopt = isinstance(deliveries, int) and deliveries > 1
        # No reply of this phase on record (the claim says): no look-up until one is made.
        own = bool(task_row.get("recorded_calls", True)) or self._adopt
        self._may_replay = own or self.counterpart is not None
        #: A branch task's counterpart's replies, read with the claim: with no reply of its
        #: own on record (a redelivery's own replies come first: the reader prefers them),
        #: its calls are answered from these without a look-up.
        claimed = task_row.get("counterpart_calls")
        self._claimed: list[dict[str, Any]] | None = (
            claimed if isinstance(claimed, list) and self.counterpart is not None and not own
            else None)

    def recorded(self) -> None:
        """A reply of this task was recorded now: later calls look the record up."""
        self._may_replay = True
        self._claimed = None  # its own reply now comes first: the reader's look-up

    async def answer(self, request: Request) -> Completion[Any] | None:
        """The recorded answer to ``request``, written as replayed; None: make the call.

        Fills ``request.record_keys`` (the request's hash per candidate model it
        compared: a memo) when it looks.
        """
        llm = self._settings.llm
        if not (llm.durable and llm.record and self._may_replay):
            return None
        if self._adopt:
            await self._adopted()
        # Either route may have answered before: look for a reply to either model.
        models = ((self._served,) if self._served
                  else (self.model_override,) if self.model_override
                  else (self._settings.models.local, self._settings.models.cloud))
        if self._claimed is not None:
            recorded = claimed_record(self._claimed, request, models)
        else:
            recorded = await self._reader.read(  # batched with other calls' reads
                self._task_id, self._phase, request.position,
                sorted(set(request.keys_for(models).values())), self.counterpart)
        if recorded is None:
            return None
        replay = replay_of(recorded, request)
        if replay is None:
            return None
        served, reply, output = replay
        if not self._replays.hold(self._charger.rows, served, reply):  # not held: write now
            await self._charger.replayed(served, reply)
        return answered(served, reply, output, self._offline, replayed=True)


    async def _adopted(self) -> None:
        """Adopt this task's journaled replies once (its calls in flight all wait for it).

        A failure is logged and the calls go on: a reply not adopted is asked again.
        """
        if self._adoption is None:
            self._adoption = asyncio.ensure_future(
                self._reader.adopt(self._task_id, self._charger.rows.lease_token))
        try:
            await asyncio.shield(self._adoption)
        except Exception as exc:
            log.warning("journaled replies not adopted", extra={
                "task_id": str(self._task_id), "error": str(exc)})
        self._adopt = False


def claimed_record(rows: list[dict[str, Any]], request: Request,
                   models: Sequence[str]) -> RecordedCall | None:
    """The newest of a claim's ``counterpart_calls`` that answered ``request``.

    What ``model_call_get_recorded_many`` finds in the counterpart's record: a row at the
    request's position whose hash is the request's for one of ``models`` (a changed
    request has another hash: it is not replayed). The request is hashed per model only
    as needed (into ``request.record_keys``): a row made by one of ``models`` is first
    checked against that model's hash, so a replayed call hashes its request once, not
    once per candidate model (a third of a replay's Python, measured in the worker).
    """
    key = request.key_for
    found = None
    for row in rows:
        if row["position"] != request.position:
            continue
        own = row["model"] in models and row["request_hash"] == key(row["model"])
        # Else it may still be another candidate's hash: every model is asked.
        if (own or row["request_hash"] in {key(m) for m in models}) and (
                found is None or row["id"] > found["id"]):
            found = row
    return None if found is None else RecordedCall.from_row(found)


def replay_of(recorded: RecordedCall,
              request: Request) -> tuple[CallProgress, ModelReply, Any] | None:
    """A recorded reply as the call it answered, its reply and its output (validated once).

    None if it is unusable: a record that no longer fits the call's schema.
    """
    data = output = None
    calls = recorded_tool_calls(recorded.tool_calls)
    if request.json_schema and not calls:
        try:
            data = parse_structured(recorded.response, request.json_schema, recorded.model)
            output = (data if request.model_cls is None
                      else request.model_cls.model_validate(data))
        except (BadModelReply, ValidationError):
            return None
    route = Route("cloud" if recorded.route == "cloud" else "local", recorded.model,
                  f"replayed from model call {recorded.call_id}")
    stored = (request_text(request.prompt, request.system, request.json_schema)
              + round_note(request.round))
    served = CallProgress.start(request, Routed(route, Decimal(0), recorded.request_hash,
                                                stored))
    reply = ModelReply(recorded.response, data, 0, 0, 0.0, recorded.model, recorded.backend,
                       offline=recorded.backend == OfflineBackend.name,
                       thinking=recorded.thinking, tool_calls=calls)
    return served, reply, output
