"""What the model layer needs from the database, as a Protocol (no Store import here).

The wiring (:func:`runtime.wiring.build_runtime`) passes an implementation over the Store
(:class:`runtime.engine.ledger.StoreLedger`) to :class:`~runtime.llm.handle.LLMFactory`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from runtime.store.rows import ModelCharge, StepBegin, StepEnd, StepRecord


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


class CallLedger(Protocol):
    """The database side of model calls: queue depth, charging, and the record of replies."""

    def pending_depth(self) -> int:
        """How many tasks are pending (routing's queue-depth signal)."""
        ...

    def charge(self, charge: ModelCharge) -> bool:
        """Record one model call row and charge it to the task; False when the lease is lost."""
        ...

    def recorded_call(self, task_id: uuid.UUID, phase: str, position: str,
                      request_hashes: Sequence[str],
                      counterpart: uuid.UUID | None = None) -> RecordedCall | None:
        """The recorded successful reply at this position for one of these request hashes.

        Several hashes because the route (and so the model in the request) may differ from
        one delivery to the next: the request is hashed once per candidate model. A task
        of a fork's branch names its ``counterpart`` (the task it re-runs): the
        counterpart's reply at the same position answers when the task has none itself.
        """
        ...


class StepLedger(Protocol):
    """The database side of durable steps: their start and their result, fenced by the lease."""

    def step_begin(self, begin: StepBegin) -> StepRecord | None:
        """Record a step as started, or return its finished record; None: lease lost."""
        ...

    def step_finish(self, end: StepEnd) -> bool:
        """Record a step's result or error and charge its cost; False: lease lost."""
        ...
