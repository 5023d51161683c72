"""The validate-and-repair stage: a structured reply that does not fit is asked again.

A reply is checked against the call's pydantic class (:func:`validated`); one that does
not fit (or is not JSON, or stopped at the token limit: the backend says so) is sent back
with the error and asked again, up to ``[llm] output_retries`` times. A repair's request
carries only the first request, the latest bad reply (cut to
:data:`MAX_REPAIR_ECHO_CHARS`) and the error: it does not grow with every attempt (it is
paid for, and must fit the budget).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from runtime.llm.reply import BadModelReply, ModelReply
from runtime.llm.request import Request

#: How much of a bad reply a repair sends back to the model.
MAX_REPAIR_ECHO_CHARS = 2000
#: How much of the error a repair tells the model.
MAX_REPAIR_REASON_CHARS = 300
#: Makes the requests of one call until one is answered (the retry stage).
Ask = Callable[[Request], Awaitable[tuple[ModelReply, Any]]]


def validated(reply: ModelReply, model_cls: type[BaseModel] | None) -> Any:
    """The reply's data, validated by ``model_cls`` (``BadModelReply`` if it does not fit)."""
    if model_cls is None or reply.data is None:
        return reply.data
    try:
        return model_cls.model_validate(reply.data).model_dump(mode="json")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise BadModelReply(
            f"the reply of model {reply.model!r} does not fit {model_cls.__name__} at "
            f"{where}: {first['msg']}", reply) from None


async def ask_with_repairs(request: Request, ask: Ask,
                           output_retries: int) -> tuple[ModelReply, Any]:
    """Ask, and ask again with the error while a structured reply is bad.

    Raises:
        BadModelReply: no reply fit the schema in 1 + ``output_retries`` attempts.

    """
    first = request.messages
    rounds = 1 + (output_retries if request.json_schema else 0)
    errors: list[str] = []
    for number in range(rounds):
        request.kind = request.first_kind if number == 0 else "repair"
        try:
            return await ask(request)
        except BadModelReply as exc:
            errors.append(str(exc))
            bad = exc.reply.text if exc.reply is not None else ""
            request.conversation = [
                *first, {"role": "assistant", "content": bad[:MAX_REPAIR_ECHO_CHARS]},
                {"role": "user", "content": (
                    f"Your reply failed: {exc.reason[:MAX_REPAIR_REASON_CHARS]}. Answer "
                    "again with only JSON that fits the schema.")}]
    raise BadModelReply(
        f"model {request.route.model!r} gave no reply that fits the schema in {rounds} "
        f"attempt(s) ({request.rows} request(s)); last error: {errors[-1]}")
