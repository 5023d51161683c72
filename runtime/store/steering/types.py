"""What the steering commands return, their error, and how an answer is checked."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from runtime.store.rows import canonical_json


class SteeringRefused(ValueError):
    """A steering command that cannot apply (wrong status, bad answer): nothing changed."""


class SteeringConflict(SteeringRefused):
    """The command is well formed, but the task's state forbids it (HTTP 409).

    Answering a task that is not an open question to ``human``, for example: the same
    request may be right for another task, so it is not bad input.
    """


@dataclass(frozen=True)
class CancelOutcome:
    """What a cancel did: how many tasks it ended, or why it was a no-op."""

    task_id: uuid.UUID
    cancelled: int
    status: str
    message: str
    ids: tuple[uuid.UUID, ...] = ()
    parents_ready: tuple[uuid.UUID, ...] = ()


@dataclass(frozen=True)
class SteerOutcome:
    """What a pause, resume, approve, reject or answer did (``changed`` False: a no-op)."""

    task_id: uuid.UUID
    changed: bool
    status: str
    message: str
    parents_ready: tuple[uuid.UUID, ...] = field(default=())


@dataclass(frozen=True)
class GateRow:
    """The model-call gate's answer for one task.

    ``lease_token`` is the task's holder now (None: nobody holds it, as while it waits for
    its judge): a caller holding another token was taken away.
    """

    status: str | None
    paused: bool
    lease_token: uuid.UUID | None = None

    @property
    def stopped(self) -> bool:
        """The task ended (cancelled, or gone): no call may start for it."""
        return self.status not in ("running", "judging")


def validate_answer(payload: Any, answer: Any) -> None:
    """Check an answer against a question's ``answer_schema`` and ``choices``.

    Raises:
        SteeringRefused: the answer does not fit (the message says why).

    """
    question = payload if isinstance(payload, dict) else {}
    choices = question.get("choices")
    if choices and answer not in choices:
        value = answer.get("choice") if isinstance(answer, dict) and len(answer) == 1 else None
        if value not in choices:
            raise SteeringRefused(
                f"answer {canonical_json(answer)} is not one of the choices "
                f"{canonical_json(choices)} (send the choice itself, or {{\"choice\": ...}})")
    schema = question.get("answer_schema")
    if schema:
        import jsonschema  # on first use (start-up)

        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(answer),
                        key=lambda e: list(e.path))
        if errors:
            where = "/".join(str(p) for p in errors[0].path) or "(root)"
            raise SteeringRefused(f"answer does not match answer_schema at {where}: "
                                  f"{errors[0].message}")
