"""A small Ollama-compatible HTTP server for tests (no model, no network beyond loopback).

It speaks the parts of Ollama's API that orgchart uses: ``POST /api/chat`` (``stream``
false, or true as NDJSON chunks whose last one carries ``done: true`` and the counts),
``format`` (a JSON schema gets a schema-valid JSON object from the offline generator;
``"json"`` gets a small object), ``GET /api/tags``, ``GET /api/version``, and a 404
``{"error": "model 'x' not found"}`` for models it does not have. ``delay_seconds`` makes
every chat slow (timeout tests), ``delay_for`` each by its request; ``reply_text`` forces
the reply (bad-JSON tests). It
counts the tokens it reported so tests can compare sums. A streamed reply comes in pieces
of ``piece_chars`` characters, ``piece_delay_seconds`` apart (thinking first, tool calls
in the last line, as Ollama sends them); ``cut_after_pieces`` closes the connection
after that many pieces, with no last line (a server or a network dying mid-reply);
``piece_log`` lists every piece written. A request whose last message is the assistant's
(a reply cut off, continued) gets the rest of its answer after that start (``continued``).

Misbehaviour (:data:`MODES`): ``script`` is a list of modes used one per chat request, in
order; ``every_call`` (``{7: "500"}``: every 7th chat request) and ``every_structured``
(``{3: "broken_json"}``: every 3rd structured reply) are standing rules, applied when the
script is empty (the first matching rule wins). ``429`` and ``503`` carry ``Retry-After:
retry_after`` seconds; ``hang`` sleeps ``hang_seconds`` before answering. A request with
``think: true`` gets ``message.thinking``, its tokens counted in ``eval_count``.
``seen`` counts every chat request by its identity (model, messages, format, options) and
``answered`` the ones that got a good reply; ``answer_log`` lists those replies as
``(identity, wall time)``: the outside's record of calls paid, for a history (issue 40).
``arrival_log`` lists every chat request as ``(identity, wall time it arrived)`` and
``sent_log`` every chat reply as ``(identity, wall time its last byte was written)``: a
test that kills a worker tells from them which answers had left the server before the
kill and whether any of them was asked for again (issue 44).

Tools: ``tool_plan(body)`` decides, for a request that lists ``tools``, which tool calls
the reply makes (a list of ``{"name", "arguments"}``; None or empty: answer as usual).
It is a function of the request, so concurrent conversations and replays each get their
own, deterministic plan (:func:`calls_until` makes the usual one). ``tool_requests``
counts the requests that listed tools.

Use it with ``from tests.fake_ollama import fake_ollama_server  # noqa: F401`` and a test
argument named ``fake_ollama`` (the fixture's name differs from the function's so that
ruff does not read the argument as a redefinition of the import).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from runtime.llm.backends.schema_instance import instance_for_schema, prompt_snippet
from runtime.llm.reply import estimate_tokens

DEFAULT_MODELS = ("llama3.2:latest", "qwen3:14b")
#: What the server can be told to do with a chat request.
MODES = ("ok", "broken_json", "wrong_shape", "empty", "length", "429", "500", "502", "503",
         "hang")
ERROR_STATUSES = {"429": 429, "500": 500, "502": 502, "503": 503}

ToolPlan = Callable[[dict[str, Any]], list[dict[str, Any]] | None]


def tool_results(body: dict[str, Any]) -> int:
    """How many tool results the request's conversation already holds."""
    return sum(1 for m in body.get("messages") or [] if m.get("role") == "tool")


def calls_until(total: int, name: str, per_round: int = 1,
                arguments: Callable[[int], dict[str, Any]] | None = None) -> ToolPlan:
    """A plan calling tool ``name`` ``per_round`` times a reply until ``total`` results are in.

    ``arguments(i)`` gives the i-th call's arguments (default ``{"n": i}``).
    """
    def plan(body: dict[str, Any]) -> list[dict[str, Any]] | None:
        done = tool_results(body)
        if done >= total:
            return None
        return [{"name": name, "arguments": (arguments or (lambda i: {"n": i}))(i)}
                for i in range(done, min(total, done + per_round))]

    return plan


def request_identity(body: dict[str, Any]) -> str:
    """A chat request's identity: sha256 of its model, messages, format and options."""
    canonical = json.dumps({k: body.get(k) for k in ("model", "messages", "format", "options")},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    # A real server's backlog (Ollama's Go listener takes the kernel's SOMAXCONN), not
    # socketserver's 5: with 5, a burst of connections overflows the accept queue and the
    # kernel delays the rest by SYN-ACK retransmits (1 s, then 3 s). A request written
    # on such a connection by a worker SIGKILLed meanwhile still arrives (the orphaned
    # socket delivers what was written), seconds after the kill, as if asked again.
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out and hung up is expected in timeout tests


class FakeOllama:
    """The server's state and counters (thread-safe)."""

    def __init__(self, models: tuple[str, ...] = DEFAULT_MODELS, host: str = "127.0.0.1") -> None:
        self.models = list(models)
        self.delay_seconds = 0.0
        #: A delay per request (its body), instead of ``delay_seconds``, when set.
        self.delay_for: Callable[[dict[str, Any]], float] | None = None
        self.reply_text: str | None = None
        #: A streamed reply's pieces: their size (characters) and the wait before each.
        self.piece_chars = 8
        self.piece_delay_seconds = 0.0
        #: A streamed reply stops after this many pieces, its connection closed (a crash);
        #: ``cuts`` of them (None: every one).
        self.cut_after_pieces: int | None = None
        self.cuts: int | None = None
        #: Every streamed piece written: (the request's user prompt, wall time, characters).
        self.piece_log: list[tuple[str, float, int]] = []
        #: Every continued request: (its user prompt, the length of the start it continued).
        self.continued: list[tuple[str, int]] = []
        self.requests: list[dict[str, Any]] = []
        self.arrived: list[dict[str, Any]] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.chats = 0
        self.script: list[str] = []
        self.every_call: dict[int, str] = {}
        self.every_structured: dict[int, str] = {}
        self.retry_after: float | None = 1.0
        self.hang_seconds = 5.0
        self.tool_plan: ToolPlan | None = None
        self.tool_requests = 0
        self.received = 0
        self.structured = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.modes: Counter[str] = Counter()
        self.seen: Counter[str] = Counter()
        self.answered: Counter[str] = Counter()
        self.answer_log: list[tuple[str, float]] = []
        self.arrival_log: list[tuple[str, float]] = []
        self.sent_log: list[tuple[str, float]] = []
        self._lock = threading.Lock()
        self._server = _QuietServer((host, 0), _handler_for(self))
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.02},
                                        name="fake-ollama", daemon=True)

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:43123``."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeOllama:
        """Serve in a background thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------ behaviour
    def next_mode(self, body: dict[str, Any]) -> str:
        """Choose what to do with one chat request (script, then rules, else ``ok``)."""
        with self._lock:
            self.received += 1
            self.seen[request_identity(body)] += 1
            self.arrival_log.append((request_identity(body), time.time()))
            mode = "ok"
            if self.script:
                mode = self.script.pop(0)
            else:
                for n, rule in sorted(self.every_call.items()):
                    if self.received % n == 0:
                        mode = rule
                        break
                if mode == "ok" and isinstance(body.get("format"), dict):
                    self.structured += 1
                    for n, rule in sorted(self.every_structured.items()):
                        if self.structured % n == 0:
                            mode = rule
                            break
            if mode not in MODES:
                raise ValueError(f"unknown fake mode {mode!r}")
            self.modes[mode] += 1
            return mode

    def enter(self, body: dict[str, Any]) -> None:
        """A chat request starts being served (tracks the most served at once, and the
        order requests arrived in: ``arrived``; ``requests`` is in the order answered)."""
        with self._lock:
            self.arrived.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        """A chat request was served."""
        with self._lock:
            self.in_flight -= 1

    def take_cut(self) -> bool:
        """Whether this streamed reply is cut (one of ``cuts`` left, or every one)."""
        with self._lock:
            if self.cuts is None:
                return True
            if self.cuts <= 0:
                return False
            self.cuts -= 1
            return True

    def piece_written(self, body: dict[str, Any], chars: int) -> None:
        """A streamed piece of ``chars`` characters was just written (``piece_log``)."""
        user = next((str(m.get("content", "")) for m in body.get("messages") or []
                     if m.get("role") == "user"), "")
        with self._lock:
            self.piece_log.append((user, time.time(), chars))

    def sent(self, body: dict[str, Any]) -> None:
        """A chat reply's last byte was just written (``sent_log``)."""
        with self._lock:
            self.sent_log.append((request_identity(body), time.time()))

    def answer(self, body: dict[str, Any], mode: str = "ok") -> dict[str, Any]:
        """Return the content, thinking, done reason and token counts for a chat request."""
        messages = body.get("messages") or []
        # The conversation's first user prompt: a repair asks again about the same thing.
        prompt = "\n".join(str(m.get("content", "")) for m in messages)
        user = next((str(m.get("content", "")) for m in messages
                     if m.get("role") == "user"), prompt)
        fmt = body.get("format")
        done_reason = "stop"
        calls = (self.tool_plan(body) if mode == "ok" and body.get("tools")
                 and self.tool_plan is not None else None)
        if calls:
            content = ""
        elif self.reply_text is not None:
            content = self.reply_text
        elif isinstance(fmt, dict):
            content = json.dumps(instance_for_schema(fmt, user))
        elif fmt == "json":
            content = json.dumps({"text": f"fake: {prompt_snippet(user)}"})
        else:
            content = f"fake: {prompt_snippet(user)}"
        if mode == "broken_json":
            content = content[: max(1, len(content) // 2)]
        elif mode == "wrong_shape":
            content = json.dumps({"unexpected": "fake: wrong shape"})
        elif mode == "empty":
            content = ""
        elif mode == "length":
            content, done_reason = content[: max(1, len(content) // 3)], "length"
        last = messages[-1] if messages else {}
        if last.get("role") == "assistant" and not last.get("tool_calls"):
            # A reply continued (its start as the assistant's last message): the rest only.
            start = str(last.get("content") or "")
            with self._lock:
                self.continued.append((user, len(start)))
            if content.startswith(start):
                content = content[len(start):]
        thinking = (f"fake thinking: the user asks about {prompt_snippet(user)}"
                    if body.get("think") else None)
        num_predict = int((body.get("options") or {}).get("num_predict") or 1 << 30)
        prompt_tokens = sum(estimate_tokens(str(m.get("content", ""))) for m in messages)
        completion_tokens = min(estimate_tokens(content) + estimate_tokens(thinking),
                                num_predict)
        with self._lock:
            self.requests.append(body)
            self.chats += 1
            self.tool_requests += 1 if body.get("tools") else 0
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            if mode == "ok" and self.reply_text is None:
                self.answered[request_identity(body)] += 1
                self.answer_log.append((request_identity(body), time.time()))
        if calls:
            completion_tokens = estimate_tokens(json.dumps(calls))
        return {"content": content, "thinking": thinking, "done_reason": done_reason,
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "tool_calls": [{"function": c} for c in calls or []]}


def _handler_for(fake: FakeOllama) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out as separate writes: without TCP_NODELAY, Nagle's
        # algorithm and the client's delayed ACK add about 40 ms to every answer.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _json(self, status: int, body: dict[str, Any],
                  headers: dict[str, str] | None = None) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            if self.path == "/api/version":
                self._json(200, {"version": "0.0.0-fake"})
            elif self.path == "/api/tags":
                self._json(200, {"models": [
                    {"name": m, "model": m, "modified_at": "2026-01-01T00:00:00Z",
                     "size": 1, "digest": f"sha256:{i:064x}", "details": {}}
                    for i, m in enumerate(fake.models)]})
            else:
                self._json(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError:
                self._json(400, {"error": "body is not JSON"})
                return
            if self.path != "/api/chat":
                self._json(404, {"error": f"no route {self.path}"})
                return
            model = body.get("model", "")
            if model not in fake.models:
                self._json(404, {"error": f"model '{model}' not found"})
                return
            mode = fake.next_mode(body)
            fake.enter(body)
            try:
                self._chat(body, model, mode)
            finally:
                fake.leave()

        def _chat(self, body: dict[str, Any], model: str, mode: str) -> None:
            delay = fake.delay_seconds if fake.delay_for is None else fake.delay_for(body)
            if delay:
                time.sleep(delay)
            if mode in ERROR_STATUSES:
                status = ERROR_STATUSES[mode]
                headers = ({"Retry-After": f"{fake.retry_after:g}"}
                           if status in (429, 503) and fake.retry_after is not None else {})
                message = {429: "too many requests", 503: "server busy, please try again"}
                self._json(status, {"error": message.get(status, "internal server error")},
                           headers)
                return
            if mode == "hang":
                time.sleep(fake.hang_seconds)
            started = time.monotonic_ns()
            answer = fake.answer(body, mode)
            content = answer["content"]
            now = dt.datetime.now(dt.UTC).isoformat()
            final = {
                "model": model, "created_at": now, "done": True,
                "done_reason": answer["done_reason"],
                "total_duration": time.monotonic_ns() - started, "load_duration": 0,
                "prompt_eval_count": answer["prompt_tokens"], "prompt_eval_duration": 0,
                "eval_count": answer["completion_tokens"], "eval_duration": 0,
            }
            if body.get("stream", True) is False:
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if answer["thinking"]:
                    message["thinking"] = answer["thinking"]
                if answer["tool_calls"]:
                    message["tool_calls"] = answer["tool_calls"]
                self._json(200, {**final, "message": message})
                self.wfile.flush()
                fake.sent(body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            size = max(1, fake.piece_chars)
            thought = answer["thinking"] or ""
            for i in range(0, len(thought), size):
                self._chunk({"model": model, "created_at": now, "done": False,
                             "message": {"role": "assistant", "content": "",
                                         "thinking": thought[i:i + size]}})
            pieces = [content[i:i + size] for i in range(0, len(content), size)]
            for n, piece in enumerate(pieces):
                if (fake.cut_after_pieces is not None and n >= fake.cut_after_pieces
                        and fake.take_cut()):
                    self.close_connection = True
                    self.wfile.flush()
                    return  # cut off mid-stream: no last chunk
                if fake.piece_delay_seconds:
                    time.sleep(fake.piece_delay_seconds)
                self._chunk({"model": model, "created_at": now, "done": False,
                             "message": {"role": "assistant", "content": piece}})
                self.wfile.flush()
                fake.piece_written(body, len(piece))
            last: dict[str, Any] = {"role": "assistant", "content": ""}
            if answer["tool_calls"]:
                last["tool_calls"] = answer["tool_calls"]
            self._chunk({**final, "message": last})
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            fake.sent(body)

        def _chunk(self, obj: dict[str, Any]) -> None:
            line = json.dumps(obj).encode() + b"\n"
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")

    return Handler


@pytest.fixture(name="fake_ollama")
def fake_ollama_server() -> Iterator[FakeOllama]:
    """A running fake Ollama server on 127.0.0.1 and a free port."""
    fake = FakeOllama().start()
    yield fake
    fake.stop()
