"""What every model backend shares: the reply, the errors, the request text and parsing.

A backend answers ``achat(model, messages, schema, max_tokens, route=..., think=...)``
with a :class:`ModelReply`; backends that also serve tools and tests offer the older
synchronous ``chat(model, prompt, system, schema, max_tokens, route=...)``. A structured
reply that is not JSON, does not fit its schema, is empty or stopped at the token limit
raises :class:`BadModelReply` carrying the reply (its tokens were spent); the model layer
asks again (``[llm] output_retries``). :class:`RetryableModelError` is a transient error
that knows its HTTP status and the server's ``Retry-After``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from agents.replies import ToolCall as ToolCall  # defined with the reply agents see
from runtime.core.canonical import canonical_sha256, sha256_hex
from runtime.errors import OrgchartError, TransientModelError

#: How long ``auto`` waits for Ollama to answer at start.
PROBE_TIMEOUT_SECONDS = 1.0
#: HTTP statuses from the model server that are worth retrying.
TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
#: Marks a model_calls prompt whose text was not kept (``[llm] record = false``).
NOT_RECORDED = "[not recorded]"

#: One chat message: ``role`` and ``content``; an assistant message that called tools
#: also has ``tool_calls``, a tool's answer has ``role: "tool"`` and ``tool_name``.
Message = dict[str, Any]


@dataclass(frozen=True)
class ModelReply:
    """What a backend answered.

    Attributes:
        text: the reply's text (the JSON text for structured output), thinking excluded.
        data: the parsed JSON when a schema was given, else None.
        prompt_tokens: tokens the prompt took (as the server reported, or estimated).
        completion_tokens: tokens the reply took (thinking included, as Ollama counts).
        duration_seconds: wall-clock time of the call.
        model: the model asked for.
        backend: ``"ollama"``, ``"offline"`` or ``"replay"``.
        offline: True when the content was made by the offline backend (also when it is
            replayed from a run recorded offline).
        thinking: a thinking model's reasoning, kept apart from the answer (or None).
        done_reason: why the model stopped (``"stop"``, ``"length"``, ...), if reported.
        tool_calls: the tools the model asked to call (a tool round), else empty.

    """

    text: str
    data: Any | None
    prompt_tokens: int
    completion_tokens: int
    duration_seconds: float
    model: str
    backend: str
    offline: bool = False
    thinking: str | None = None
    done_reason: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


class BadModelReply(OrgchartError):
    """The model's reply is not valid JSON for the requested schema (an agent failure)."""

    def __init__(self, message: str, reply: ModelReply | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.reply = reply
        #: What was wrong, without the reply's text (what a repair tells the model).
        self.reason = reason or message


class RetryableModelError(TransientModelError):
    """A transient failure of one request: its HTTP status (if any) and ``Retry-After``."""

    def __init__(self, message: str, status: int | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class ModelRequestError(OrgchartError):
    """The model server refused the request for a reason retrying will not fix."""


class ReplayMiss(OrgchartError):
    """The replay file has no response for this request (an agent failure)."""


class BackendConfigError(OrgchartError, ValueError):
    """``[llm]`` settings that cannot give a backend (for example replay without a file)."""


class Backend:
    """A model backend: ``achat``, and what it can do, declared (issue 46).

    The defaults are a backend that can do none of it; each backend overrides what it
    can. The model layer reads these, never probes for them.
    """

    name: str = "backend"
    #: Its requests go to a server: the model layer reads their replies on its reply loop.
    remote: bool = False
    #: It can continue a reply from a recorded prefix (a call cut off goes on).
    continues_prefix: bool = False

    @property
    def offline(self) -> bool:
        """Its answers are not a model's work (canned, or a replay of such)."""
        return False

    @property
    def served_model(self) -> tuple[str, Decimal] | None:
        """The one model it serves on every route, with its price; None: the routes'."""
        return None

    def host_for(self, route: str) -> str:
        """The server a route's calls go to (one call-slot pool per server)."""
        return self.name

    def parallel_for(self, route: str) -> int | None:
        """Its own limit of calls at once on ``route`` (None: only ``[ollama]``'s)."""
        return None

    def recorder_spec(self) -> tuple[str, tuple[Any, ...]] | None:
        """How the recorder process builds this backend: its kind and its arguments.

        None (the default): its replies are read and recorded in this process
        (:mod:`runtime.llm.recorder`).
        """
        return None

    async def achat(self, model: str, messages: Sequence[Message],
                    schema: dict[str, Any] | None, max_tokens: int, *,
                    route: str = "local", think: bool = False) -> ModelReply:
        """Send one conversation and return the reply.

        A backend that serves tool calling also takes ``tools=`` (Ollama's list of
        ``{"type": "function", ...}``); the model layer passes it only when tools are given.
        """
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close the connections it opened on the running loop (none by default)."""

    def close(self) -> None:
        """Release what it holds (nothing by default)."""


# ---------------------------------------------------------------------- helpers
def estimate_tokens(text: str | None) -> int:
    """Estimate the tokens of ``text`` without a tokenizer (deterministic, conservative).

    The larger of words x 4/3 and characters / 4, so JSON without spaces is not undercounted.
    """
    if not text:
        return 0
    return max(round(len(text.split()) * 4 / 3), math.ceil(len(text) / 4), 1)


def schema_digest(schema: Mapping[str, Any]) -> str:
    """Return a short, stable hash of a JSON schema (canonical JSON)."""
    return canonical_sha256(schema)[:16]


def request_text(prompt: str, system: str | None = None,
                 schema: Mapping[str, Any] | None = None) -> str:
    """Return the model-independent text of a request (stored in ``model_calls.prompt``).

    A bare prompt is stored as is; a system prompt and a schema add labelled sections
    (the schema as its title and a hash), so the stored text identifies the request.
    """
    if system is None and not schema:
        return prompt
    text = f"[system]\n{system}\n\n[user]\n{prompt}" if system is not None else prompt
    if schema:
        title = schema.get("title") or "schema"
        text += f"\n\n[format] json schema {title} sha256:{schema_digest(schema)}"
    return text


def request_key(prompt: str, system: str | None = None,
                schema: Mapping[str, Any] | None = None) -> str:
    """Return the replay key of a request: sha256 of :func:`request_text` (no model name)."""
    return sha256_hex(request_text(prompt, system, schema))


def first_messages(prompt: str, system: str | None) -> list[Message]:
    """The conversation of a fresh call: an optional system message, then the prompt."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": prompt})
    return messages


def message_tokens(messages: Sequence[Message]) -> int:
    """Estimated prompt tokens of a conversation (tool calls' arguments included)."""
    total = 0
    for m in messages:
        total += estimate_tokens(m.get("content"))
        if m.get("tool_calls"):
            total += estimate_tokens(json.dumps(m["tool_calls"], default=str))
    return total


def split_messages(messages: Sequence[Message]) -> tuple[str, str | None]:
    """Return ``(prompt, system)`` of a conversation: its first user and system messages."""
    system = next((m["content"] for m in messages if m.get("role") == "system"), None)
    prompt = next((m["content"] for m in messages if m.get("role") == "user"), "")
    return prompt, system


def parse_structured(text: str, schema: Mapping[str, Any], model: str) -> Any:
    """Parse a structured reply and check it against ``schema``.

    Raises:
        BadModelReply: the text is empty or not JSON, or the JSON does not fit the schema.

    """
    if not text.strip():
        raise BadModelReply(f"model {model!r} was asked for JSON but replied with nothing")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        reason = f"the reply is not JSON ({exc.msg} at position {exc.pos})"
        raise BadModelReply(
            f"model {model!r} was asked for JSON but replied with text that is not JSON "
            f"({exc.msg} at position {exc.pos}): {text[:200]!r}", reason=reason
        ) from None
    import jsonschema  # on first use (start-up)

    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise BadModelReply(
            f"the JSON reply of model {model!r} does not fit the schema at {where}: "
            f"{error.message}"
        )
    return data


def checked_reply(reply: ModelReply, schema: Mapping[str, Any] | None) -> ModelReply:
    """Return ``reply`` with its parsed data, or raise :class:`BadModelReply` carrying it.

    A structured reply fails when it stopped at the token limit (``done_reason ==
    "length"``: the JSON is cut), is empty, is not JSON, or does not fit ``schema``.
    """
    if not schema or reply.tool_calls:
        return reply  # a tool round has no answer to check yet
    if reply.done_reason == "length":
        raise BadModelReply(
            f"the reply of model {reply.model!r} stopped at the token limit "
            f"({reply.completion_tokens} tokens) before its JSON was complete", reply)
    try:
        data = parse_structured(reply.text, schema, reply.model)
    except BadModelReply as exc:
        raise BadModelReply(str(exc), reply, exc.reason) from None
    return ModelReply(reply.text, data, reply.prompt_tokens, reply.completion_tokens,
                      reply.duration_seconds, reply.model, reply.backend, reply.offline,
                      reply.thinking, reply.done_reason, reply.tool_calls)
