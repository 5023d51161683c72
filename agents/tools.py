"""Tools and durable steps, as agents declare them: :class:`Tool`, :class:`RetryPolicy`.

An agent lists its tools (``tools = (Tool(...), ...)``) and hands them to the model with
``ctx.llm.complete(prompt, tools=self.tools)``: the model layer runs Ollama's tool loop,
every call of a tool being a durable step (``runtime.llm.durable_steps``). The same machinery is
open to any side effect: ``ctx.step(name, fn, *args, **kwargs)``.

A step's function can read its stable idempotency key with :func:`idempotency_key` (or
declare a keyword parameter named ``idempotency_key``): the same on every delivery of the
task, so an external system can deduplicate a request sent again after a crash.
"""

from __future__ import annotations

import contextvars
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ValidationError

from runtime.core import backoff

#: A tool's name as Ollama and MCP accept it.
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

_STEP_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "orgchart_step_idempotency_key", default=None)


def idempotency_key() -> str:
    """The idempotency key of the step running now (inside a step's function only).

    Raises:
        LookupError: called outside a step.

    """
    key = _STEP_KEY.get()
    if key is None:
        raise LookupError("idempotency_key() is only set inside a step's function")
    return key


def set_step_key(key: str | None) -> contextvars.Token[str | None]:
    """Set the running step's key (the runtime does this around a step's function)."""
    return _STEP_KEY.set(key)


def reset_step_key(token: contextvars.Token[str | None]) -> None:
    """Undo :func:`set_step_key`."""
    _STEP_KEY.reset(token)


class TransientStepError(Exception):
    """Raise it from a step's function for a failure worth retrying (see RetryPolicy)."""


class BadToolArguments(ValueError):
    """Arguments a model gave a tool that do not fit the tool's schema."""


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of a step's function for transient errors, with exponential backoff.

    Attributes:
        attempts: tries in all (1: no retry).
        backoff_seconds: the first wait; it doubles per retry, up to ``max_backoff_seconds``.
        on: the exception types that are retried; any other error is recorded at once.

    """

    attempts: int = 3
    backoff_seconds: float = 0.5
    max_backoff_seconds: float = 30.0
    on: tuple[type[BaseException], ...] = (TransientStepError, ConnectionError, TimeoutError)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be at least 1 (got {self.attempts})")
        if self.backoff_seconds < 0 or self.max_backoff_seconds < 0:
            raise ValueError("RetryPolicy backoffs must not be negative")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1, 2, ...)."""
        return backoff.delay(retry - 1, self.backoff_seconds, self.max_backoff_seconds)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: name, description, arguments schema, function.

    Attributes:
        name: what the model calls it (letters, digits, ``_ . -``; at most 64).
        description: what it does, for the model.
        args: a pydantic model of its arguments; the function gets them as keywords.
        fn: the function, plain or ``async def``; its result must be JSON-serialisable.
        parameters: a JSON schema instead of ``args`` (MCP tools); validated with it.
        cost_usd: charged to the task per call that runs (not for a replay).
        requires_approval: a person must approve each call before it runs: the task waits
            in ``awaiting_approval`` until ``orgchart approve`` (run phase only).
        retry: retries for transient errors (default: none).
        source: where it came from (``python``, or ``mcp:<server>``).

    """

    name: str
    description: str
    args: type[BaseModel] | None
    fn: Callable[..., Any]
    parameters: dict[str, Any] | None = None
    cost_usd: Decimal = Decimal(0)
    requires_approval: bool = False
    retry: RetryPolicy | None = None
    source: str = "python"
    _schema: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not TOOL_NAME.match(self.name or ""):
            raise ValueError(f"tool name {self.name!r} must match {TOOL_NAME.pattern}")
        if (self.args is None) == (self.parameters is None):
            raise ValueError(f"tool {self.name!r} needs exactly one of args= (a pydantic "
                             "model) or parameters= (a JSON schema)")
        if self.args is not None and not (isinstance(self.args, type)
                                          and issubclass(self.args, BaseModel)):
            raise ValueError(f"tool {self.name!r}: args must be a pydantic model class")
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn must be callable")
        object.__setattr__(self, "cost_usd", Decimal(str(self.cost_usd)))
        if self.cost_usd < 0:
            raise ValueError(f"tool {self.name!r}: cost_usd must not be negative")
        schema = self.parameters if self.args is None else self.args.model_json_schema()
        object.__setattr__(self, "_schema", dict(schema or {"type": "object"}))

    @property
    def json_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (what the model is shown)."""
        return self._schema

    @property
    def is_async(self) -> bool:
        """Whether ``fn`` is an ``async def`` function (several run at once)."""
        return inspect.iscoroutinefunction(self.fn)

    def ollama_spec(self) -> dict[str, Any]:
        """The tool as Ollama's chat request lists it (``{"type": "function", ...}``)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": self.json_schema}}

    def validate(self, arguments: Any) -> dict[str, Any]:
        """The keyword arguments for ``fn``, checked against the schema.

        Raises:
            BadToolArguments: they do not fit (the message says where and why).

        """
        if not isinstance(arguments, dict):
            raise BadToolArguments(f"arguments must be a JSON object, not "
                                   f"{type(arguments).__name__}")
        if self.args is not None:
            try:
                value = self.args.model_validate(arguments)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"]) or "(root)"
                raise BadToolArguments(f"{where}: {first['msg']}") from None
            return {name: getattr(value, name) for name in type(value).model_fields}
        import jsonschema  # on first use (start-up)

        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(self.json_schema).iter_errors(arguments))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            raise BadToolArguments(f"{where}: {error.message}")
        return dict(arguments)


def described(tools: tuple[Tool, ...] | list[Tool]) -> list[dict[str, Any]]:
    """Each tool's name, description, source, cost, approval and schema (``orgchart agents``)."""
    return [{"name": t.name, "description": t.description, "source": t.source,
             "cost_usd": str(t.cost_usd), "requires_approval": t.requires_approval,
             "schema": t.json_schema} for t in tools]
