"""What a model call answers an agent: :class:`Completion`, typed by the call's schema.

``ctx.llm.complete(prompt, schema=Plan)`` returns a ``Completion[Plan]``: its ``output`` is
a ``Plan`` instance, and type checkers know it (the overloads of
:class:`agents.context.LLM`). A tool loop's reply also carries the tool calls the model
asked for (:class:`ToolCall`) and what the loop ran (:class:`ToolOutcome`). The model
layer (``runtime.llm``) builds these values; agents only read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ToolCall:
    """One tool call a model's reply asked for (Ollama's ``message.tool_calls[i]``).

    Attributes:
        name: the tool's name.
        arguments: the arguments the model gave (a dict when it gave JSON).
        id: the call's id, stable across deliveries (``<position>.<round>.<index>``).

    """

    name: str
    arguments: Any
    id: str = ""

    def as_json(self) -> dict[str, Any]:
        """The call as recorded in ``model_calls.tool_calls``."""
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    def as_message_part(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry sends it back."""
        return {"function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolOutcome:
    """One tool call of a loop, as the agent sees it in ``Completion.tool_calls``.

    Attributes:
        id: the call's id (``<call>#<round>.<index>``), stable across deliveries.
        name: the tool called.
        arguments: the arguments the model gave.
        result: the tool's JSON result (None on error).
        error: why the call failed (bad arguments, not allowed, the tool raised), or None.
        replayed: True when served from the record of an earlier delivery.

    """

    id: str
    name: str
    arguments: Any
    result: Any
    error: str | None
    replayed: bool


@dataclass(frozen=True)
class Completion(Generic[T]):
    """One answered model call, as an agent sees it: ``Completion[T]``, ``T`` its output's type.

    ``ctx.llm.complete(prompt, schema=Plan)`` returns a ``Completion[Plan]`` (type
    checkers see it): ``reply.output`` is a ``Plan`` instance. Without a schema it is a
    ``Completion[str]`` (``output`` is the text); with a JSON schema dict, a
    ``Completion[Any]`` (``output`` is the parsed JSON).

    Attributes:
        text: the reply text (JSON text for structured output), thinking excluded.
        output: the answer as its type: an instance of the ``schema=`` class, the parsed
            JSON for a schema dict, else the text.
        data: the parsed reply when a schema was given (a JSON-ready dict for a pydantic
            model, validated by it), else None.
        prompt_tokens / completion_tokens: tokens of the request that answered (zero when
            replayed from the record).
        cost_usd: what the whole call cost (every attempt; zero when replayed).
        route / model / route_reason: where the call went and why.
        backend: ``ollama``, ``offline`` or ``replay``.
        offline: True when the answer came from the offline backend (not a model's work),
            directly or replayed from a run recorded offline.
        call_index: the call's order of issue in this task's run of the agent.
        position: the call's identity in the task (``key=``, else ``call_index``).
        attempts: requests made (1 + retries + repairs; 0 when replayed).
        replayed: True when served from the record of an earlier delivery.
        thinking: a thinking model's reasoning (``[ollama] think``), else None.
        tool_calls: the tools this reply asked to call (one round of a tool loop).
        tool_results: what the tool loop ran (``tools=``): one outcome per call, in order.
        tool_rounds: the rounds of tool calls the loop ran.

    """

    text: str
    output: T
    data: Any
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal
    route: str
    model: str
    backend: str
    offline: bool
    route_reason: str = ""
    duration_seconds: float = 0.0
    call_index: int = 0
    position: str = "0"
    attempts: int = 1
    replayed: bool = False
    thinking: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_results: tuple[ToolOutcome, ...] = ()
    tool_rounds: int = 0
