"""The Ollama backend: ``/api/chat`` through the official async client.

Calls go to ``[ollama] url``, and to ``[ollama] cloud_url`` for the cloud route when it is
set. Per server, limit and event loop, one :class:`ollama.AsyncClient` whose httpx transport
is :class:`~runtime.llm.backends.transport.StreamTransport`: at most ``[ollama]
max_parallel`` / ``cloud_max_parallel`` connections (the same limit as the call slots of
:meth:`runtime.llm.loop.CallLoop.slot`), kept alive (httpx's default transport costs about
3 ms of Python per call with a thousand in flight; measured on the makespan bench, it
was most of the worker's CPU). Failures are classified here:

- unreachable, reset, timed out, or HTTP 408/425/429/5xx ->
  :class:`~runtime.llm.reply.RetryableModelError` (with the ``Retry-After`` seconds the
  server sent on 429/503, read by an httpx response hook);
- 404 -> :class:`~runtime.errors.ModelNotFound`; any other refusal ->
  :class:`~runtime.llm.reply.ModelRequestError`;
- a structured reply that does not parse -> :class:`~runtime.llm.reply.BadModelReply`.

A reply is handed to :func:`runtime.llm.arrival.reply_arrived` the moment it is parsed,
before it is checked against the call's schema: the model layer records it then.

Streaming (``[streaming]`` on: the send stage set a text hook,
:func:`runtime.llm.text_stream.text_hook`): the request says ``"stream": true`` and each
NDJSON line's content goes to the hook as it arrives; the reply is put together from the
lines and recorded on arrival of the last one, exactly as a non-streamed reply. With no
hook, the request is the non-streamed one of before. A free-text call cut off
mid-generation on an earlier delivery continues from its recorded text
(:data:`runtime.llm.text_stream.CONTINUE_FROM`): that text goes as the assistant's last
message, and the reply is it plus what Ollama generates after it.

This is the only module that imports ``ollama``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import ollama
import orjson

from runtime.config import Settings
from runtime.errors import ModelNotFound
from runtime.llm.arrival import reply_arrived
from runtime.llm.backends.transport import LeanAsyncClient
from runtime.llm.reply import (
    PROBE_TIMEOUT_SECONDS,
    TRANSIENT_STATUSES,
    Backend,
    Message,
    ModelReply,
    ModelRequestError,
    RetryableModelError,
    ToolCall,
    checked_reply,
    estimate_tokens,
    first_messages,
    message_tokens,
)
from runtime.llm.text_stream import continued_text, text_hook

log = logging.getLogger(__name__)

#: Where the response hook leaves the ``Retry-After`` of the request being made.
_RETRY_AFTER: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "orgchart_retry_after", default=None)


def retry_after_seconds(value: str | None) -> float | None:
    """Read a ``Retry-After`` header given in seconds; None when absent or a date."""
    if not value:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        return None


async def _note_retry_after(response: httpx.Response) -> None:
    box = _RETRY_AFTER.get()
    if box is not None and response.status_code in (429, 503):
        seconds = retry_after_seconds(response.headers.get("retry-after"))
        if seconds is not None:
            box["retry_after"] = seconds


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context for every https client (building one loads the CA bundle: ~20 ms)."""
    return httpx.create_ssl_context()


class _Client(ollama.AsyncClient):
    """The official async client, over :class:`~runtime.llm.backends.transport.LeanAsyncClient`.

    Everything Ollama-specific (request and response types, errors) is the ``ollama``
    package's; only the httpx client class under it differs.
    """

    def __init__(self, host: str, **kwargs: Any) -> None:
        # ollama.AsyncClient.__init__ passes httpx.AsyncClient; its base takes the class.
        super(ollama.AsyncClient, self).__init__(LeanAsyncClient, host, **kwargs)

    @property
    def http(self) -> LeanAsyncClient:
        """The httpx client under it: its ``timeout``, its connection pool (``pool``)."""
        client: LeanAsyncClient = self._client
        return client

    async def text_chat(self, model: str, messages: Sequence[Message],
                        schema: dict[str, Any] | None, options: dict[str, Any],
                        think: bool,
                        tools: Sequence[dict[str, Any]] = ()) -> ollama.ChatResponse:
        """``chat(..., stream=False)`` for text messages and tools (no images).

        Sends the body ``chat`` would (``ChatRequest(...).model_dump(exclude_none=True)``;
        a test holds the two equal) without building and dumping its pydantic models for
        every call; the response, its type and the errors are ``chat``'s own.
        """
        body = _chat_body(model, messages, schema, options, think, tools, stream=False)
        return await self._request(ollama.ChatResponse, "POST", "/api/chat", json=body,
                                   stream=False)

    async def text_chat_streamed(self, model: str, messages: Sequence[Message],
                                 schema: dict[str, Any] | None, options: dict[str, Any],
                                 think: bool, tools: Sequence[dict[str, Any]],
                                 on_text: Callable[[str], None]) -> ollama.ChatResponse:
        """:meth:`text_chat` with ``"stream": true``: ``on_text`` gets the content as it comes.

        Ollama answers with NDJSON lines, each a piece of the message (``content``,
        ``thinking``, ``tool_calls``); the last one says ``done`` and carries the counts.
        Returned as the one ``ChatResponse`` a non-streamed call gets: the last line's
        fields, the message put together. ``timeout_seconds`` bounds each wait for the
        next bytes, not the whole reply. Errors as :meth:`text_chat`'s (``ResponseError``
        with the status; one sent inside the stream has none: -1).
        """
        body = _chat_body(model, messages, schema, options, think, tools, stream=True)
        client: LeanAsyncClient = self._client
        response = await client.open_stream("POST", "/api/chat", body)
        content: list[str] = []
        thinking: list[str] = []
        calls: list[Any] = []
        last: dict[str, Any] | None = None
        try:
            if response.status_code >= 400:
                await response.aread()
                raise _response_error(response)
            async for part in _ndjson(response):
                if part.get("error"):
                    raise ollama.ResponseError(str(part["error"]))
                message = part.get("message") or {}
                if text := message.get("content"):
                    content.append(text)
                    on_text(text)
                if text := message.get("thinking"):
                    thinking.append(text)
                calls.extend(message.get("tool_calls") or ())
                if part.get("done"):
                    last = part
        finally:
            await response.aclose()
        if last is None:
            raise httpx.RemoteProtocolError("the streamed reply ended before its last line")
        message = {"role": "assistant", "content": "".join(content),
                   "thinking": "".join(thinking) or None, "tool_calls": calls or None}
        return ollama.ChatResponse(**{**last, "message": message})


def _chat_body(model: str, messages: Sequence[Message], schema: dict[str, Any] | None,
               options: dict[str, Any], think: bool, tools: Sequence[dict[str, Any]], *,
               stream: bool) -> dict[str, Any]:
    """The body ``chat`` sends (``ChatRequest(...).model_dump(exclude_none=True)``)."""
    body: dict[str, Any] = {
        "model": model, "stream": stream, "options": options, "tools": list(tools),
        "think": think,
        # chat() drops empty fields of a message the same way
        "messages": [{k: v for k, v in m.items() if v} for m in messages],
    }
    if schema:
        body["format"] = schema
    return body


async def _ndjson(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The NDJSON lines of a streamed body as they arrive, parsed (orjson).

    Split by hand on the raw bytes and parsed by orjson: 1.2 us a line, against 4.4 us
    through httpx's text and line decoders and ``json`` (measured on one Ollama line;
    900 calls streaming 20 pieces a second each are 18,000 lines a second on the reply
    loop).
    """
    rest = b""
    # The body's own stream (the transport's, or httpx's on a proxied URL), not
    # aiter_raw's layer around it; the caller closes the response.
    async for data in response.stream:  # type: ignore[union-attr]
        lines = (rest + data).split(b"\n")
        rest = lines.pop()
        for line in lines:
            if line.strip():
                yield orjson.loads(line)
    if rest.strip():
        yield orjson.loads(rest)


def _response_error(response: httpx.Response) -> ollama.ResponseError:
    """The official client's error for a refused request (its ``error`` text, its status)."""
    try:
        error = str(response.json()["error"])
    except (ValueError, KeyError, TypeError):
        error = response.text
    return ollama.ResponseError(error, response.status_code)


class OllamaBackend(Backend):
    """Ollama through the official client; the cloud route may go to a second server."""

    name = "ollama"
    #: Its requests go to a server: the model layer reads their replies on its reply loop.
    remote = True
    #: A call cut off mid-generation continues from its recorded text: the text is sent
    #: as the assistant's last message, which Ollama's chat continues (the way Ollama's
    #: maintainers give for it, ollama/ollama#6778; how well depends on the template).
    continues_prefix = True

    def __init__(self, url: str, timeout_seconds: float, cloud_url: str | None = None,
                 max_parallel: int = 8, cloud_max_parallel: int = 8) -> None:
        self.url = url
        self.cloud_url = cloud_url or None
        self.timeout_seconds = timeout_seconds
        self.max_parallel = max_parallel
        self.cloud_max_parallel = cloud_max_parallel
        self._clients: dict[tuple[int, str, int], _Client] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> OllamaBackend:
        """Build from ``[ollama] url, timeout_seconds, cloud_url, max_parallel, ...``."""
        o = settings.ollama
        return cls(o.url, o.timeout_seconds, o.cloud_url, o.max_parallel,
                   o.cloud_max_parallel)

    def recorder_spec(self) -> tuple[str, tuple[Any, ...]]:
        """What the recorder process builds this backend from (:meth:`from_spec`)."""
        return ("ollama", (self.url, self.timeout_seconds, self.cloud_url, self.max_parallel,
                           self.cloud_max_parallel))

    @classmethod
    def from_spec(cls, args: tuple[Any, ...]) -> OllamaBackend:
        """The backend of :meth:`recorder_spec`'s arguments (in the recorder process)."""
        return cls(*args)

    def host_for(self, route: str) -> str:
        """Return the server a route's calls go to."""
        return self.cloud_url if route == "cloud" and self.cloud_url else self.url

    def parallel_for(self, route: str) -> int:
        """How many calls may be in flight at once to one model on ``route``'s server."""
        return self.cloud_max_parallel if route == "cloud" else self.max_parallel

    def new_client(self, host: str, parallel: int) -> _Client:
        """A new client to ``host``, at most ``parallel`` connections (the caller closes it)."""
        return _Client(host=host, timeout=self.timeout_seconds, max_connections=parallel,
                       ssl_context=_tls_context() if host.startswith("https:") else None,
                       event_hooks={"response": [_note_retry_after]})

    def client_for(self, route: str) -> _Client:
        """The client ``route``'s calls go through on the running loop (kept; see aclose)."""
        # One client (one connection pool) per loop, server and limit: the same key as the
        # call slots of runtime.llm.loop.CallLoop.slot, so the pool is never smaller than
        # the calls the slots let through.
        host, parallel = self.host_for(route), self.parallel_for(route)
        key = (id(asyncio.get_running_loop()), host, parallel)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = self.new_client(host, parallel)
        return client

    async def achat(self, model: str, messages: Sequence[Message],
                    schema: dict[str, Any] | None, max_tokens: int, *,
                    route: str = "local", think: bool = False,
                    tools: Sequence[dict[str, Any]] = ()) -> ModelReply:
        """Call ``/api/chat`` once (no streaming) on the running loop.

        ``tools`` (Ollama's function specs) lets the model answer with tool calls
        (:attr:`ModelReply.tool_calls`) instead of text.

        Raises:
            RetryableModelError: unreachable, timed out, or busy (429, 5xx).
            ModelNotFound: the server does not have ``model`` (404).
            ModelRequestError: any other refusal.
            BadModelReply: a schema was given and the reply does not fit it.

        """
        return await self._send(self.client_for(route), self.host_for(route), model,
                                messages, schema, max_tokens, think, tools)

    async def _send(self, client: _Client, host: str, model: str,
                    messages: Sequence[Message], schema: dict[str, Any] | None,
                    max_tokens: int, think: bool,
                    tools: Sequence[dict[str, Any]] = ()) -> ModelReply:
        box: dict[str, float] = {}
        token = _RETRY_AFTER.set(box)
        started = time.monotonic()
        on_text = text_hook()  # [streaming] on: the text is recorded as it comes
        options = {"num_predict": max_tokens}
        # A call cut off mid-generation goes on from its recorded text: the text as the
        # assistant's last message, which Ollama continues (a free-text call only).
        prefix = "" if schema or tools else (continued_text() or "")
        if prefix:
            messages = [*messages, {"role": "assistant", "content": prefix}]
        try:
            response = await (
                client.text_chat(model, messages, schema, options, think, tools)
                if on_text is None else
                client.text_chat_streamed(model, messages, schema, options, think, tools,
                                          on_text))
        except json.JSONDecodeError as exc:  # (orjson's error is one too)
            raise RetryableModelError(
                f"model server {host} sent a streamed line that is not JSON for "
                f"{model!r}: {exc}") from exc
        except ollama.ResponseError as exc:
            if exc.status_code == 404:
                raise ModelNotFound(model, f"{host} answered 404: {exc.error}") from exc
            if exc.status_code in TRANSIENT_STATUSES or exc.status_code < 0:
                raise RetryableModelError(
                    f"model server {host} answered {exc.status_code} for {model!r}: "
                    f"{exc.error}", exc.status_code, box.get("retry_after")) from exc
            raise ModelRequestError(
                f"model server {host} refused the request for {model!r} "
                f"(HTTP {exc.status_code}): {exc.error}"
            ) from exc
        except httpx.PoolTimeout as exc:  # (a TimeoutException: before the general case)
            raise RetryableModelError(
                f"model server {host}: the call for {model!r} {exc}") from exc
        except httpx.TimeoutException as exc:
            raise RetryableModelError(
                f"model server {host} did not answer within {self.timeout_seconds} s "
                f"(ollama.timeout_seconds) for {model!r}"
            ) from exc
        except (httpx.TransportError, ConnectionError) as exc:
            raise RetryableModelError(f"model server {host} is unreachable: {exc}") from exc
        finally:
            _RETRY_AFTER.reset(token)
        reply = self._reply(response, model, messages, time.monotonic() - started, prefix)
        reply_arrived(reply)  # recorded now, before it is checked (runtime/llm/arrival.py)
        return checked_reply(reply, schema)

    def _reply(self, response: ollama.ChatResponse, model: str, messages: Sequence[Message],
               duration: float, prefix: str) -> ModelReply:
        """The reply of a response (a continued one starts with its recorded ``prefix``)."""
        text = prefix + (response.message.content or "")
        thinking = response.message.thinking or None
        # Ollama leaves prompt_eval_count out when the whole prompt was cached: estimate
        # rather than charge nothing. eval_count includes the thinking tokens.
        prompt_tokens = response.prompt_eval_count
        if prompt_tokens is None:
            prompt_tokens = message_tokens(messages)
        completion_tokens = response.eval_count
        if completion_tokens is None:
            completion_tokens = estimate_tokens(text) + estimate_tokens(thinking)
        elif prefix:  # generated by the delivery that died, never charged: counted here
            completion_tokens += estimate_tokens(prefix)
        calls = tuple(ToolCall(c.function.name, dict(c.function.arguments or {}))
                      for c in response.message.tool_calls or ())
        return ModelReply(text, None, int(prompt_tokens), int(completion_tokens), duration,
                          model, self.name, thinking=thinking,
                          done_reason=response.done_reason, tool_calls=calls)

    def chat(self, model: str, prompt: str, system: str | None, schema: dict[str, Any] | None,
             max_tokens: int, *, route: str = "local", think: bool = False) -> ModelReply:
        """Call ``/api/chat`` once from synchronous code (a fresh client, its own loop).

        Raises the same errors as :meth:`achat`.
        """
        async def once() -> ModelReply:
            client = self.new_client(self.host_for(route), 1)
            try:
                return await self._send(client, self.host_for(route), model,
                                        first_messages(prompt, system), schema, max_tokens,
                                        think)
            finally:
                await client.close()  # type: ignore[no-untyped-call]  # (ollama's: untyped)

        return asyncio.run(once())

    def probe(self, timeout: float = PROBE_TIMEOUT_SECONDS) -> bool:
        """Return True when the local server answers ``/api/tags`` within ``timeout``."""
        client = ollama.Client(host=self.url, timeout=timeout)
        try:
            client.list()
            return True
        except Exception as exc:  # any failure means "not usable now"
            log.debug("ollama probe failed", extra={"url": self.url, "error": str(exc)})
            return False
        finally:
            client.close()  # type: ignore[no-untyped-call]  # (ollama's: untyped)

    async def aclose(self) -> None:
        """Close the connections opened on the running loop."""
        loop_id = id(asyncio.get_running_loop())
        for key in [k for k in self._clients if k[0] == loop_id]:
            await self._clients.pop(key).close()  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Forget clients of loops that are gone (their sockets close with them)."""
        self._clients.clear()
