"""What the agent gets for one model call: :func:`answered` builds its ``Completion``.

The reply type itself, :class:`agents.replies.Completion`, is the agents' (they read it,
and type checkers see its output's type); the model layer fills it in here.
"""

from __future__ import annotations

from typing import Any

from agents.replies import Completion
from runtime.llm.reply import Backend, ModelReply
from runtime.llm.request import CallProgress


def is_offline(backend: Backend) -> bool:
    """Offline backend, or a replay of a run that was recorded offline."""
    return backend.offline


def output_of(call: CallProgress, text: str, data: Any) -> Any:
    """A reply's ``output``: an instance of the call's pydantic class, its JSON, or its text."""
    if call.request.model_cls is not None and data is not None:
        return call.request.model_cls.model_validate(data)
    if call.request.json_schema is not None:
        return data
    return text


def answered(call: CallProgress, reply: ModelReply, data: Any, offline: bool,
             replayed: bool = False) -> Completion[Any]:
    """What the agent gets for an answered (or ``replayed``) call."""
    route = call.routed.route
    return Completion(
        text=reply.text, output=output_of(call, reply.text, data), data=data,
        prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens, cost_usd=call.cost, route=route.route,
        model=route.model, backend=reply.backend, offline=offline or reply.offline,
        route_reason=route.reason, duration_seconds=reply.duration_seconds,
        call_index=call.request.call_index, position=call.request.position, attempts=call.rows,
        replayed=replayed, thinking=reply.thinking, tool_calls=reply.tool_calls)
