"""The records the model layer and the store pass each other, in neither of them.

A model call's row to charge (:class:`ModelCharge`), a durable step's begin, record and
end (:class:`StepBegin`, :class:`StepRecord`, :class:`StepEnd`), and a recorded reply
and its look-up (:class:`RecordedCall`, :class:`RecordLookup`). The model layer
(``runtime.llm``) writes and reads them through its ledger protocol
(``runtime/llm/ledger.py``); the store (``runtime.store``) stores them; the engine's
``StoreLedger`` hands them from one to the other. Plain values, no I/O, no imports of
the project's parts.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any


@dataclass(frozen=True)
class ModelCharge:
    """One model call to record and charge to a task."""

    task_id: uuid.UUID
    lease_token: uuid.UUID
    attempt: int
    call_index: int
    backend: str
    route: str
    route_reason: str
    model: str
    prompt: str
    response: str | None
    prompt_tokens: int
    completion_tokens: int
    duration_seconds: float
    cost_usd: Decimal
    error: str | None = None
    #: The call's identity: the task's phase (run, aggregate, judge), its position in that
    #: phase (the order of issue, or ``key:<key>``) and the sha256 of the request.
    phase: str = "run"
    position: str | None = None
    request_hash: str | None = None
    #: ``call`` (the first request), ``retry`` (after a transient error) or ``repair``
    #: (asked again after a bad reply); ``call_try`` numbers the requests of one call.
    attempt_kind: str = "call"
    call_try: int = 1
    #: Served from the record of an earlier delivery (charged zero).
    replayed: bool = False
    thinking: str | None = None
    #: The tool calls the reply asked for (``[{"id", "name", "arguments"}]``), if any.
    tool_calls: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class StepBegin:
    """A durable step about to run: its identity in the task, and the lease that fences it.

    ``args`` is the arguments' JSON, cut to a display size; ``args_hash`` is the sha256 of
    all of it (the same place with other arguments is another step).
    """

    task_id: uuid.UUID
    lease_token: uuid.UUID
    phase: str
    position: str
    name: str
    args: str
    args_hash: str
    idempotency_key: str
    attempt: int
    kind: str = "step"
    tool_call_id: str | None = None


@dataclass(frozen=True)
class StepRecord:
    """A step's row after :class:`StepBegin`: started now, or served from the record."""

    step_id: int
    status: str
    starts: int
    replays: int
    result: Any
    error: str | None
    idempotency_key: str
    replayed: bool


@dataclass(frozen=True)
class StepEnd:
    """A started step's outcome: its JSON result, or its error; what it cost; how long."""

    task_id: uuid.UUID
    lease_token: uuid.UUID
    step_id: int
    starts: int
    result: Any
    error: str | None
    tries: int
    duration_seconds: float
    cost_usd: Decimal = Decimal(0)


@dataclass(frozen=True)
class RecordedCall:
    """The recorded successful reply of one durable model call.

    Attributes:
        call_id: the ``model_calls`` row it was read from.
        request_hash: the hash of the request it answered.
        response: the reply text (JSON text for structured output).
        thinking: the thinking text kept beside it, if any.
        model / route / backend: where the reply came from.
        prompt_tokens / completion_tokens: what it cost when it was made.
        tool_calls: the tool calls the reply asked for, if any.

    """

    call_id: int
    request_hash: str
    response: str
    thinking: str | None
    model: str
    route: str
    backend: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: list[dict[str, Any]] | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> RecordedCall:
        """A ``model_calls`` row (a look-up's result, or a claim's ``counterpart_calls``)."""
        return cls(
            call_id=int(row["id"]), request_hash=str(row["request_hash"]),
            response=str(row["response"]), thinking=row.get("thinking"),
            model=str(row["model"]), route=str(row["route"]), backend=str(row["backend"]),
            prompt_tokens=int(row["prompt_tokens"] or 0),
            completion_tokens=int(row["completion_tokens"] or 0),
            tool_calls=row.get("tool_calls"))


@dataclass(frozen=True)
class RecordLookup:
    """One durable call's look-up: the task, phase, position, hashes (and counterpart)."""

    task_id: uuid.UUID
    phase: str
    position: str
    hashes: tuple[str, ...]
    counterpart: uuid.UUID | None = None
