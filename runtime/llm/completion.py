"""What an agent gets for one model call: :class:`Completion`, built by :func:`answered`."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.reply import Backend, ModelReply, ToolCall
from runtime.llm.request import Request
from runtime.llm.tool_loop import ToolOutcome


@dataclass(frozen=True)
class Completion:
    """One answered model call, as an agent sees it.

    Attributes:
        text: the reply text (JSON text for structured output), thinking excluded.
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


def is_offline(backend: Backend) -> bool:
    """Offline backend, or a replay of a run that was recorded offline."""
    return backend.name == OfflineBackend.name or bool(getattr(backend, "offline", False))


def answered(call: Request, reply: ModelReply, data: Any, offline: bool,
             replayed: bool = False) -> Completion:
    """What the agent gets for an answered (or ``replayed``) call."""
    return Completion(
        text=reply.text, data=data, prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens, cost_usd=call.cost, route=call.route.route,
        model=call.route.model, backend=reply.backend, offline=offline or reply.offline,
        route_reason=call.route.reason, duration_seconds=reply.duration_seconds,
        call_index=call.call_index, position=call.position, attempts=call.rows,
        replayed=replayed, thinking=reply.thinking, tool_calls=reply.tool_calls)
