"""The offline backend: deterministic answers with no network, every one labelled offline.

A schema gets a schema-valid instance derived from a hash of the prompt
(:func:`~runtime.llm.backends.schema_instance.instance_for_schema`); plain text is
``offline: <the prompt's start>``. For tests it can be told to misbehave: ``script`` is a
list of behaviours used one per call, in order (then it behaves again):

- ``"ok"``: a good answer;
- ``"broken_json"``, ``"wrong_shape"``, ``"empty"``, ``"length"``: a bad structured reply
  (not JSON, JSON that misses the schema, nothing, cut at the token limit);
- ``"transient"``: a :class:`~runtime.llm.reply.RetryableModelError` (HTTP 503).

Text is streamed word by word (:func:`runtime.llm.text_stream.text_in_pieces`) before
the reply is returned, so streaming readers see the shape of a model server's reply.

Tools: given ``tools=``, a conversation with no tool result yet is answered with one call
of each tool (arguments built from the tool's parameter schema and the prompt, like a
structured answer); once tool results are in the conversation it answers as usual. So
an agent's tool loop runs one round offline, deterministically, with no model.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from runtime.llm.backends.schema_instance import instance_for_schema, offline_text
from runtime.llm.reply import (
    Backend,
    Message,
    ModelReply,
    RetryableModelError,
    ToolCall,
    checked_reply,
    estimate_tokens,
    first_messages,
    message_tokens,
)
from runtime.llm.text_stream import text_in_pieces

#: Behaviours the offline backend can be scripted with.
BEHAVIOURS = ("ok", "broken_json", "wrong_shape", "empty", "length", "transient")


class OfflineBackend(Backend):
    """Deterministic answers with no network; everything it says is labelled offline."""

    name = "offline"

    @property
    def offline(self) -> bool:
        """Always: its answers are canned, not a model's."""
        return True

    def __init__(self, script: Iterable[str] = ()) -> None:
        self.script = list(script)
        unknown = [b for b in self.script if b not in BEHAVIOURS]
        if unknown:
            raise ValueError(f"unknown offline behaviours {unknown}; known: {BEHAVIOURS}")
        self.calls = 0
        self._lock = threading.Lock()

    def _next_behaviour(self) -> str:
        with self._lock:
            self.calls += 1
            return self.script.pop(0) if self.script else "ok"

    async def achat(self, model: str, messages: Sequence[Message],
                    schema: dict[str, Any] | None, max_tokens: int, *,
                    route: str = "local", think: bool = False,
                    tools: Sequence[dict[str, Any]] = ()) -> ModelReply:
        """Answer the conversation's first user prompt (see :meth:`chat`), or call tools."""
        if tools and not any(m.get("role") == "tool" for m in messages):
            return self._tool_round(model, messages, tools, max_tokens)
        return self._answer(model, messages, schema, max_tokens)

    def _tool_round(self, model: str, messages: Sequence[Message],
                    tools: Sequence[dict[str, Any]], max_tokens: int) -> ModelReply:
        """Call every tool once, with arguments made from its schema and the prompt."""
        prompt = next((m["content"] for m in messages if m.get("role") == "user"), "")
        calls = []
        for spec in tools:
            function = spec.get("function") or {}
            parameters = function.get("parameters") or {"type": "object"}
            calls.append(ToolCall(str(function.get("name")),
                                  instance_for_schema(parameters, prompt)))
        text = json.dumps([c.as_json() for c in calls])
        return ModelReply("", None, message_tokens(messages),
                          min(estimate_tokens(text), max(int(max_tokens), 0)), 0.0, model,
                          self.name, offline=True, done_reason="stop", tool_calls=tuple(calls))

    def chat(self, model: str, prompt: str, system: str | None, schema: dict[str, Any] | None,
             max_tokens: int, *, route: str = "local", think: bool = False) -> ModelReply:
        """Answer from a hash of the prompt: a schema-valid instance, or ``offline: ...``."""
        return self._answer(model, first_messages(prompt, system), schema, max_tokens)

    def _answer(self, model: str, messages: Sequence[Message], schema: dict[str, Any] | None,
                max_tokens: int) -> ModelReply:
        behaviour = self._next_behaviour()
        if behaviour == "transient":
            raise RetryableModelError(f"offline backend told to fail ({model!r} busy)", 503)
        prompt = next((m["content"] for m in messages if m.get("role") == "user"), "")
        done_reason = "stop"
        if schema:
            data = instance_for_schema(schema, prompt)
            text = json.dumps(data, ensure_ascii=False)
            if behaviour == "broken_json":
                text = text[: max(1, len(text) // 2)]
            elif behaviour == "wrong_shape":
                text = json.dumps({"unexpected": "offline: wrong shape"})
            elif behaviour == "empty":
                text = ""
            elif behaviour == "length":
                done_reason = "length"
        else:
            text = offline_text(prompt)
        prompt_tokens = message_tokens(messages)
        completion_tokens = min(estimate_tokens(text), max(int(max_tokens), 0))
        text_in_pieces(text)  # streamed word by word, as a model server's reply would be
        reply = ModelReply(text, None, prompt_tokens, completion_tokens, 0.0, model, self.name,
                           offline=True, done_reason=done_reason)
        return checked_reply(reply, schema)
