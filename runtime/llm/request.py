"""One model call as values: what was asked, where it goes, and its requests so far.

``ctx.llm.acomplete(...)`` builds a :class:`Request` from its arguments: frozen, the
call's identity (prompt, system, schema, completion cap, position, tool round). Each
stage of the call (run in order by :meth:`runtime.llm.handle.TaskLLM._call`) reads it:

- the record look-up (:mod:`runtime.llm.recorded`) reads the ask and its hashes
  (:func:`request_hashes`, a durable call's identity; :meth:`Request.key_for` keeps each
  model's, a memo of a pure function, so a hash is computed once per call);
- the route (:class:`runtime.llm.routing.Router`) decides a
  :class:`~runtime.llm.routing.Routed`, frozen and
  set once: the route and model, the price per token, the record key and the prompt as
  its rows store it;
- the rest of the call is its :class:`CallProgress`, the one mutable object of a call,
  named so: the messages and kind of the next request (repair and retry set them), the
  budget reservation and the row of the request in flight (the send stage and the
  charge), and the requests made so far and their cost. One call's requests are made
  one after the other, so its stages write into it without a lock.

Why a mutable progress object rather than a new frozen value per request: the arrival
hook (:mod:`runtime.llm.arrival`) runs on whatever thread read the reply and records the
reply's row into the request in flight, and the send stage's ``finally`` settles the
budget with what that row charged; with frozen values each stage would have to return
the next one through the backends' callbacks, a rewrite of the send path for no reader's
gain. What is decided once (the ask, the route) cannot change; what changes per request
is in one object whose name says it does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from runtime.budget import Reservation
from runtime.core.canonical import canonical_json, canonical_sha256, sha256_hex
from runtime.errors import BadInput
from runtime.llm.reply import Message, first_messages
from runtime.llm.routing import Routed
from runtime.llm.tool_loop import ToolRound

if TYPE_CHECKING:  # (charging builds requests' rows: it imports this module)
    from runtime.llm.charging import Arrival

@dataclass(frozen=True)
class Request:
    """One logical model call as asked: its identity, frozen.

    Attributes:
        prompt / system: the user prompt and the optional system prompt.
        json_schema / model_cls: the structured output's JSON schema, and its pydantic
            class when one was given (the reply is validated by it).
        max_tokens: the completion cap the agent asked (part of the identity; the budget
            may send less).
        think: ``[ollama] think`` when the call was made.
        call_index / position: the call's order of issue in the task, and its identity
            (``key:<key>``, else the order; ``<position>#<round>`` in a tool loop).
        round: the tool loop's round this call is (its conversation and tools), if any.
        record_keys: the request's hash per model computed so far (:meth:`key_for`): a
            memo, not a decision (the hash of a model is always the same).

    """

    prompt: str
    system: str | None
    json_schema: dict[str, Any] | None
    model_cls: type[BaseModel] | None
    max_tokens: int
    think: bool
    call_index: int
    position: str
    round: ToolRound | None = None
    record_keys: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def at(self, position: str, round_: ToolRound | None = None) -> Request:
        """The call at ``position`` (a tool loop's round: its conversation and tools)."""
        if position == self.position and round_ is self.round:
            return self
        return dataclasses.replace(self, position=position, round=round_, record_keys={})

    @property
    def messages(self) -> list[Message]:
        """The request's first messages: the prompt's, or the tool loop's conversation."""
        if self.round is not None:
            return list(self.round.conversation)
        return first_messages(self.prompt, self.system)

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tools offered with the request (a round of a tool loop), else none."""
        return self.round.specs if self.round is not None else []

    @property
    def first_kind(self) -> str:
        """The kind of the first request: ``repair`` after a round of bad tool arguments."""
        return "repair" if self.round is not None and self.round.repair else "call"

    def hashes(self, models: Sequence[str]) -> dict[str, str]:
        """The record key of this request for each of ``models`` (:func:`request_hashes`)."""
        return request_hashes(models, self.messages, self.json_schema, self.max_tokens,
                              self.think, self.tools or None)

    def key_for(self, model: str) -> str:
        """The record key of this request for ``model``, computed once (:attr:`record_keys`)."""
        key = self.record_keys.get(model)
        if key is None:
            key = self.record_keys[model] = self.hashes((model,))[model]
        return key

    def keys_for(self, models: Sequence[str]) -> dict[str, str]:
        """:meth:`key_for` of each of ``models``, the missing ones serialised once."""
        missing = [m for m in models if m not in self.record_keys]
        if missing:
            self.record_keys.update(self.hashes(missing))
        return {m: self.record_keys[m] for m in models}


@dataclass(eq=False)
class CallProgress:
    """The one mutable object of a call: its requests so far and the one in flight.

    Attributes:
        request / routed: the call as asked and as routed (both frozen).
        conversation / kind: the messages of the next request and its kind (``call``,
            ``retry`` or ``repair``): set by the retry and repair stages.
        held: the budget reservation of the request in flight (the send stage's).
        arrival: the row of the request in flight's reply, queued the moment it arrived
            (:meth:`runtime.llm.charging.Charger.arrived`), until the next request.
        rows / cost: requests made so far and what they cost together.

    """

    request: Request
    routed: Routed
    conversation: list[Message]
    kind: str
    held: Reservation | None = None
    arrival: Arrival | None = None
    rows: int = 0
    cost: Decimal = field(default_factory=lambda: Decimal(0))

    @classmethod
    def start(cls, request: Request, routed: Routed) -> CallProgress:
        """A call about to make its first request."""
        return cls(request, routed, request.messages, request.first_kind)


def request_hashes(models: Sequence[str], messages: list[Message],
                   schema: dict[str, Any] | None, max_tokens: int, think: bool,
                   tools: list[dict[str, Any]] | None = None) -> dict[str, str]:
    """:func:`request_hash` of one request for each of ``models``, serialised once.

    The canonical JSON's keys are sorted (``messages``, ``model``, ``options``,
    ``schema``, ``tools``), so the text around the model is the same for every model:
    it is built once and each model's hash is the same bytes :func:`request_hash` hashes.
    """
    head = '{"messages":' + canonical_json(messages) + ',"model":'
    tail = (',"options":{"num_predict":' + canonical_json(max_tokens)
            + (',"think":true}' if think else ',"think":false}')
            + ',"schema":' + ("null" if schema is None else canonical_json(schema))
            + (',"tools":' + canonical_json(tools) if tools else "") + "}")
    return {model: sha256_hex(head + canonical_json(model) + tail) for model in models}


def request_hash(model: str, messages: list[Message], schema: dict[str, Any] | None,
                 max_tokens: int, think: bool,
                 tools: list[dict[str, Any]] | None = None) -> str:
    """sha256 of a request's canonical JSON: model, messages, schema, tools and options.

    ``max_tokens`` is what the agent asked (not what the budget left), so the same call
    hashes the same on every delivery. ``tools`` count only when given.
    """
    body = {"model": model, "messages": messages, "schema": schema,
            "options": {"num_predict": max_tokens, "think": think}}
    if tools:
        body["tools"] = tools
    return canonical_sha256(body)


def schema_of(schema: Any) -> tuple[dict[str, Any] | None, type[BaseModel] | None]:
    """The JSON schema of a call's ``schema=`` argument, and its pydantic class if it is one."""
    if schema is None:
        return None, None
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema.model_json_schema(), schema
    if isinstance(schema, dict):
        return schema, None
    raise BadInput(f"schema must be a pydantic model class or a JSON schema dict, "
                   f"not {type(schema).__name__}")
