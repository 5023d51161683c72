"""Errors that cross module boundaries and decide a task's fate in the worker.

``TransientModelError`` -> back to pending with backoff (``2 ** retry_count`` seconds, up
to ``retry.max_retry``); ``ModelNotFound`` -> failed; ``BudgetExceeded`` -> failed with
an error beginning ``budget:``; ``UnknownPrice`` -> escalated (a policy violation, never a
silent zero cost); ``LeaseLost`` -> the worker drops the task (another owns it now).
"""

from __future__ import annotations


class OrgchartError(Exception):
    """Base class of orgchart's own errors."""


class TransientModelError(OrgchartError):
    """The model server is unreachable or timed out; worth retrying later."""


class ModelNotFound(OrgchartError):
    """The model server does not have the requested model."""

    def __init__(self, model: str, detail: str = "") -> None:
        super().__init__(
            f"model {model!r} not found on the model server"
            + (f" ({detail})" if detail else "")
            + f"; pull it (ollama pull {model}) or change [models] in orgchart.toml"
        )
        self.model = model


class BudgetExceeded(OrgchartError):
    """A model call would overrun the task's budget; nothing was spent."""

    def __init__(self, message: str) -> None:
        super().__init__(message if message.startswith("budget:") else f"budget: {message}")


class UnknownPrice(OrgchartError):
    """A model without a configured price: a policy violation (rule ``model_price``)."""

    rule = "model_price"


class LeaseLost(OrgchartError):
    """The task's lease was taken away (reaped or timed out); stop working on it."""


class BadInput(OrgchartError, ValueError):
    """Input refused before anything was written (CLI exit 2, HTTP 422)."""
