"""The validate-and-repair stage: a structured reply that does not fit is asked again.

A reply is checked against the call's pydantic class once (:func:`validated`: the
instance is the agent's output); one that does
not fit (or is not JSON, or stopped at the token limit: the backend says so) is sent back
with the error and asked again, up to ``[llm] output_retries`` times. A repair's request
carries only the first request, the latest bad reply (cut to
:data:`MAX_REPAIR_ECHO_CHARS`) and the error: it does not grow with every attempt (it is
paid for, and must fit the budget).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from runtime.llm.reply import BadModelReply, ModelReply
from runtime.llm.request import CallProgress, Request

#: How much of a bad reply a repair sends back to the model.
MAX_REPAIR_ECHO_CHARS = 2000
#: How much of the error a repair tells the model.
MAX_REPAIR_REASON_CHARS = 300


def validated(reply: ModelReply, model_cls: type[BaseModel] | None) -> Any:
    """The reply's output: its data as a ``model_cls`` instance (else its data as parsed).

    The one validation of a reply by the call's pydantic class: the instance is what the
    agent gets (``Completion.output``), and ``Completion.data`` is its JSON
    (:func:`runtime.llm.completion.answered`); nothing validates it again.

    Raises:
        BadModelReply: the data does not fit ``model_cls``.

    """
    if model_cls is None or reply.data is None:
        return reply.data
    try:
        return model_cls.model_validate(reply.data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise BadModelReply(
            f"the reply of model {reply.model!r} does not fit {model_cls.__name__} at "
            f"{where}: {first['msg']}", reply) from None


class Repairs:
    """One call's repairs: after a bad structured reply, the next request asks again.

    :meth:`again` is called by the pipeline (:meth:`runtime.llm.handle.TaskLLM._call`)
    with each bad reply; it sets the next request's conversation (the first request, the
    bad reply, the error) and kind, or raises when the call has no round left.

    Args:
        request: the call (its first messages, and whether it is structured).
        output_retries: ``[llm] output_retries``: repairs of a structured call.

    """

    def __init__(self, request: Request, output_retries: int) -> None:
        self._first = request.messages
        self.rounds = 1 + (output_retries if request.json_schema else 0)
        self._errors: list[str] = []

    def again(self, exc: BadModelReply, call: CallProgress) -> None:
        """Make ``call``'s next request a repair of ``exc``'s reply.

        Raises:
            BadModelReply: no reply fit the schema in :attr:`rounds` attempts.

        """
        self._errors.append(str(exc))
        if len(self._errors) >= self.rounds:
            raise BadModelReply(
                f"model {call.routed.route.model!r} gave no reply that fits the schema in "
                f"{self.rounds} attempt(s) ({call.rows} request(s)); last error: "
                f"{self._errors[-1]}") from None
        bad = exc.reply.text if exc.reply is not None else ""
        call.conversation = [
            *self._first, {"role": "assistant", "content": bad[:MAX_REPAIR_ECHO_CHARS]},
            {"role": "user", "content": (
                f"Your reply failed: {exc.reason[:MAX_REPAIR_REASON_CHARS]}. Answer "
                "again with only JSON that fits the schema.")}]
        call.kind = "repair"
