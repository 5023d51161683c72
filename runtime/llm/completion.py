"""What the agent gets for one model call: :func:`answered` builds its ``Completion``.

The reply type itself, :class:`agents.replies.Completion`, is the agents' (they read it,
and type checkers see its output's type); the model layer fills it in here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from agents.replies import Completion
from runtime.llm.reply import Backend, ModelReply
from runtime.llm.request import CallProgress


def is_offline(backend: Backend) -> bool:
    """Offline backend, or a replay of a run that was recorded offline."""
    return backend.offline


def answered(call: CallProgress, reply: ModelReply, output: Any, offline: bool,
             replayed: bool = False) -> Completion[Any]:
    """What the agent gets for an answered (or ``replayed``) call.

    ``output`` is the validated reply (:func:`runtime.llm.repair.validated`): an instance
    of the call's pydantic class (its ``data`` is the instance's JSON, dumped, not
    validated again), the parsed JSON of a schema dict; without a schema the output is
    the text.
    """
    route = call.routed.route
    data = output.model_dump(mode="json") if isinstance(output, BaseModel) else output
    if call.request.json_schema is None:
        output, data = reply.text, reply.data
    return Completion(
        text=reply.text, output=output, data=data,
        prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens, cost_usd=call.cost, route=route.route,
        model=route.model, backend=reply.backend, offline=offline or reply.offline,
        route_reason=route.reason, duration_seconds=reply.duration_seconds,
        call_index=call.request.call_index, position=call.request.position, attempts=call.rows,
        replayed=replayed, thinking=reply.thinking, tool_calls=reply.tool_calls)
