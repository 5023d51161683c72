"""The recorder process: a server's replies are read and recorded by a process of their own.

An answer is durable on arrival (SPEC section 15). Read in the worker's process, it waited
for the interpreter lock behind the worker's own work: in a burst of a thousand answers
the median one was read 185 ms after it left the server, and a SIGKILL then lost nine in
ten of the answers already sent (issue 44, docs/performance.md). So the requests of a
backend that talks to a server (:meth:`~runtime.llm.reply.Backend.recorder_spec`: Ollama)
are made by the *recorder process* (:mod:`runtime.engine.recorder_process`), a child of
the worker with its own interpreter lock and nothing else to do: it sends the request,
reads the reply the moment its bytes arrive, journals its ``model_calls`` row
(``call_replies``: one INSERT per batch of replies, committed at once), then tells the
worker and queues the row to its own charge writer (group-committed, fenced by the
task's lease as in the worker). The worker's stages (slots, the start gate, validation,
repair, the budget) stay where they were; the reply reaches them with its row and the
future of its write (:data:`runtime.llm.arrival.Recorded`).

The worker's side is :class:`Recorder`, used on the model layer's reply loop
(:mod:`runtime.llm.reply_loop`). Messages are pickled, each after its length (4 bytes),
over a socket pair; the child is the worker's own program, so pickle trusts no stranger:

- worker to recorder: :class:`Hello` (the database), then ``("call", id, CallSpec)`` and
  ``("cancel", id)``, and ``("stop", 0)`` from a worker that stops (its calls in flight
  are cancelled at once; only a socket closed without it is a worker's death);
- recorder to worker, per call: ``("sent", id)`` once the request's bytes are written (the
  start gate's hook), ``("text", id, str)`` as a streamed reply grows, ``("arrived", id,
  reply, row)`` when its row is journaled (and its charge queued), ``("done", id,
  reply)`` (None: the reply that arrived) or ``("error", id, exc)``, after ``arrived``,
  and ``("written", id, ok)`` when the row's batch committed (True) or was refused (False:
  the lease was gone), or the error that failed it; ``("log", 0, level, text)``: its own
  warnings, logged by the worker (the recorder's standard streams are closed, so that a
  worker's output ends when the worker does).

When the worker dies (SIGKILL, OOM), the socket closes: the recorder lets the calls in
flight finish for up to :data:`runtime.engine.recorder_process.GRACE_SECONDS`, records
their answers (the task's next delivery replays them instead of paying again; a row whose
lease was taken back meanwhile is refused by the fence), writes what is queued and exits.
When both die (the process group killed), a reply journaled whose charge had not
committed is adopted by the task's next delivery (:mod:`runtime.store.call_replies`).
When the recorder dies, the worker's calls in flight fail as retryable and the next call
starts a new one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from runtime.llm.arrival import ON_ARRIVAL
from runtime.llm.gate import REQUEST_SENT
from runtime.llm.reply import Message, ModelReply, RetryableModelError
from runtime.llm.text_stream import ON_TEXT
from runtime.records import ModelCharge

log = logging.getLogger(__name__)

#: A message's length, before its pickled bytes.
_LENGTH = struct.Struct("!I")
#: How long closing waits for the recorder to write what it holds and exit.
CLOSE_TIMEOUT_SECONDS = 30.0
#: The module the recorder process runs (``python -m``).
PROCESS_MODULE = "runtime.engine.recorder_process"


def framed(message: object) -> bytes:
    """One message as sent: its length, then its pickled bytes."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


class Channel(asyncio.Protocol):
    """Messages over a socket, both ways: each pickled after its length.

    What one turn of the loop sends goes in one write (a burst of replies is a few
    system calls, not one per message); what arrives is cut into messages in
    ``data_received`` and handed to ``on_message`` in order. It belongs to the loop that
    made it: a message sent from another thread (a warning logged by a writer thread) is
    handed to that loop first.
    """

    def __init__(self, on_message: Callable[[Any], None]) -> None:
        self._on_message = on_message
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        #: Done once the other side closed the socket (or this side did).
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport (asyncio's call)."""
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        """Hand on every whole message received (asyncio's call)."""
        buffer = self._buffer
        buffer += data
        at, size = 0, len(buffer)
        while size - at >= _LENGTH.size:
            length = _LENGTH.unpack_from(buffer, at)[0]
            end = at + _LENGTH.size + length
            if end > size:
                break
            message = pickle.loads(buffer[at + _LENGTH.size:end])
            at = end
            self._on_message(message)
        del buffer[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket is closed (asyncio's call)."""
        self._transport = None
        if not self.closed.done():
            self.closed.set_result(None)

    @property
    def is_open(self) -> bool:
        """Whether messages can still be sent."""
        return self._transport is not None and not self._transport.is_closing()

    def send(self, message: object) -> None:
        """Send ``message`` with the others of this turn of the loop (dropped once closed).

        From another thread than the loop's, the loop sends it (raises RuntimeError once
        the loop is closed).
        """
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.send, message)
            return
        if not self.is_open:
            return
        self._out.append(framed(message))
        if len(self._out) == 1:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self._out and self._transport is not None:
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def close(self) -> None:
        """Send what waits, then close the socket."""
        self._flush()
        if self._transport is not None:
            self._transport.close()


@dataclass(frozen=True)
class Hello:
    """The recorder's first message: where it records (the worker's database)."""

    database_url: str
    statement_timeout_ms: int = 0


@dataclass(frozen=True)
class CallSpec:
    """One request for the recorder to make and record.

    Attributes:
        backend: the backend's kind and arguments (:meth:`Backend.recorder_spec`).
        model / messages / schema / max_tokens / route / think / tools: ``achat``'s.
        prefix: the recorded text of a call cut off, which the backend continues.
        stream: send the reply's text back as it streams.
        row / price / keep_text: the request's ``model_calls`` row before its reply
            (:meth:`runtime.llm.call_records.Rows.template`), the price per token, and
            whether the row keeps the reply's text.

    """

    backend: tuple[str, tuple[Any, ...]]
    model: str
    messages: Sequence[Message]
    schema: dict[str, Any] | None
    max_tokens: int
    route: str
    think: bool
    tools: Sequence[dict[str, Any]]
    prefix: str | None
    stream: bool
    row: ModelCharge
    price: Decimal
    keep_text: bool


class _Call:
    """A call in flight: its result and the hooks its messages go to (on the reply loop)."""

    __slots__ = ("arrived", "reply", "result", "sent", "text")

    def __init__(self, result: asyncio.Future[ModelReply]) -> None:
        self.result = result
        #: The reply that arrived (``done`` without one means this one).
        self.reply: ModelReply | None = None
        self.sent = REQUEST_SENT.get()
        self.text = ON_TEXT.get()
        self.arrived = ON_ARRIVAL.get()


class Recorder:
    """The worker's side of one recorder process (see the module doc); on the reply loop.

    Args:
        hello: what the process records into.

    """

    def __init__(self, hello: Hello) -> None:
        self.hello = hello
        self.users = 0
        self._proc: subprocess.Popen[bytes] | None = None
        #: The worker's end of a started process's socket, until the first call uses it.
        self._socket: socket.socket | None = None
        self._spawning = threading.Lock()
        self._channel: Channel | None = None
        self._calls: dict[int, _Call] = {}
        #: Rows queued by the recorder whose write's outcome has not come yet.
        self._writes: dict[int, Future[bool]] = {}
        self._ids = 0
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """The recorder process's id while it runs (tests, diagnostics)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    async def achat(self, spec: CallSpec) -> ModelReply:
        """Make ``spec``'s request in the recorder; its reply (recorded on arrival) or error.

        The running context's hooks get what the recorder says: the start gate's (sent),
        the streamed text's, the arrival's (the row and the future of its write).
        """
        channel = await self._connected()
        self._ids += 1
        call_id = self._ids
        call = self._calls[call_id] = _Call(asyncio.get_running_loop().create_future())
        try:
            channel.send(("call", call_id, spec))
            return await call.result
        except asyncio.CancelledError:
            channel.send(("cancel", call_id))
            raise
        finally:
            self._calls.pop(call_id, None)

    async def _connected(self) -> Channel:
        """The connection to a running recorder process (started on first use)."""
        async with self._lock:
            if self._channel is None or not self._channel.is_open:
                self._channel = await self._start()
            return self._channel

    def prestart(self) -> None:
        """Start the process now (a worker starting), so no call waits for its start.

        From any thread; the connection is made on the reply loop by the first call.
        """
        with self._spawning:
            if self._proc is None or self._proc.poll() is not None:
                mine, theirs = socket.socketpair()
                try:
                    self._proc = subprocess.Popen(  # this program, by module name
                        [sys.executable, "-m", PROCESS_MODULE, str(theirs.fileno())],
                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        env=os.environ.copy())
                finally:
                    theirs.close()
                self._socket = mine
                log.info("started the model-call recorder process",
                         extra={"pid": self._proc.pid})

    async def _start(self) -> Channel:
        with self._spawning:
            mine, self._socket = self._socket, None
        if mine is None:  # not started, or its connection is gone: a new process
            self.prestart()
            with self._spawning:
                mine, self._socket = self._socket, None
        assert mine is not None
        _, channel = await asyncio.get_running_loop().create_connection(
            lambda: Channel(self._dispatch), sock=mine)
        channel.send(self.hello)
        channel.closed.add_done_callback(lambda _: self._ended())
        return channel

    def _ended(self) -> None:
        """The recorder closed the socket: its calls in flight fail (retryable)."""
        ended = RetryableModelError("the model-call recorder process ended with the call "
                                    "in flight")
        for call in list(self._calls.values()):
            if not call.result.done():
                call.result.set_exception(ended)
        for outcome in self._writes.values():
            if not outcome.done():
                outcome.set_exception(ended)
        self._writes.clear()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind, call_id = message[0], message[1]
        if kind == "log":  # the recorder's own warnings (its standard streams are closed)
            log.log(message[2], "model-call recorder: %s", message[3])
            return
        if kind == "written":
            written = self._writes.pop(call_id, None)
            if written is not None:
                if isinstance(message[2], BaseException):
                    written.set_exception(message[2])
                else:
                    written.set_result(bool(message[2]))
            return
        call = self._calls.get(call_id)
        if call is None:  # cancelled meanwhile: nobody waits for it
            return
        if kind == "text":
            if call.text is not None:
                call.text(message[2])
        elif kind == "sent":
            if call.sent is not None:
                call.sent()
        elif kind == "arrived":
            outcome: Future[bool] = Future()
            self._writes[call_id] = outcome
            call.reply = message[2]
            if call.arrived is not None:
                call.arrived(message[2], (message[3], outcome))
        elif kind == "done":
            reply = message[2] if message[2] is not None else call.reply
            if not call.result.done() and reply is not None:
                call.result.set_result(reply)
        elif kind == "error" and not call.result.done():
            call.result.set_exception(message[2])

    async def aclose(self) -> None:
        """Close the connection; wait for the process to write what it holds and exit."""
        async with self._lock:
            channel, proc = self._channel, self._proc
            self._channel = self._proc = None
        with self._spawning:
            unused, self._socket = self._socket, None
        if unused is not None:  # started, never called: closing it ends the process
            unused.close()
        if channel is not None:
            channel.send(("stop", 0))  # a worker that stops: its calls in flight are dropped
            channel.close()
            await channel.closed
        if proc is not None:
            await asyncio.to_thread(_wait_or_kill, proc)


def _wait_or_kill(proc: subprocess.Popen[bytes]) -> None:
    """Wait for the recorder to exit; SIGKILL it past :data:`CLOSE_TIMEOUT_SECONDS`."""
    try:
        proc.wait(CLOSE_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        log.warning("the model-call recorder did not exit in time; killed",
                    extra={"pid": proc.pid})
        proc.kill()
        proc.wait()


class Recorders:
    """The process's recorders, one per database, shared by the model layers using it.

    :meth:`acquire` counts a user (a model-call factory) and :meth:`release` closes the
    recorder once its last user is done (acquire from any thread, release on the reply loop).
    """

    def __init__(self) -> None:
        self._recorders: dict[Hello, Recorder] = {}
        self._lock = threading.Lock()

    def acquire(self, hello: Hello) -> Recorder:
        """The recorder of ``hello``'s database, counting one more user."""
        with self._lock:
            recorder = self._recorders.get(hello)
            if recorder is None:
                recorder = self._recorders[hello] = Recorder(hello)
            recorder.users += 1
            return recorder

    async def release(self, recorder: Recorder) -> None:
        """One user fewer; the last one closes the recorder (its process exits)."""
        with self._lock:
            recorder.users -= 1
            last = recorder.users <= 0
            if last and self._recorders.get(recorder.hello) is recorder:
                del self._recorders[recorder.hello]
        if last:
            await recorder.aclose()


#: This process's recorders.
RECORDERS = Recorders()
