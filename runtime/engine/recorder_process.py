"""The recorder process's program: make a worker's model requests, record each reply on arrival.

``python -m runtime.engine.recorder_process FD`` is started by the worker's model layer
(:class:`runtime.llm.recorder.Recorder`), FD its end of a socket pair; the protocol and
the reasons are in :mod:`runtime.llm.recorder`. It does nothing else: no agents, no
claims. Its event loop reads the worker's requests, makes each one with the backend the
request names (built once per kind and arguments), and the moment a reply is parsed its
``model_calls`` row (the row the worker would have written:
:func:`runtime.llm.call_records.arrived_row`) is queued to the :class:`Journal`, before
the reply is checked. The journal writes the replies that arrived together with one
INSERT into ``call_replies`` and commits at once (nothing else locked: the reply is
durable); then, on the loop, each reply goes to the worker (``arrived``, then ``done``)
and its charge to this process's :class:`~runtime.engine.charges.ChargeWriter` (fenced
by the task's lease token; a charge updates the task and waits for its tree's clock).
So the worker handles no reply that is not on record, and in a burst the worker's work
(validation, the agent, its transitions) does not take the host's CPU from the replies
still to be read and journaled. A task's next delivery adopts a journaled reply whose
charge never committed (:mod:`runtime.store.call_replies`).

``RECORDER_TRACE_DIR`` (a directory; for ``python -m bench.recorder_lag`` only) makes
the process log each journal batch and charge batch with its replies' arrival times,
and its loop's late wake-ups.

It ends when the worker closes the socket, or dies: the calls in flight get up to
:data:`GRACE_SECONDS` to finish and be recorded, then are cancelled; the journal and the
charge writer write what they hold, and the process exits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pickle
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Connection, Engine

from runtime.engine.charges import CHARGE_LANES, ChargeWriter
from runtime.engine.recorder_trace import TracedWriter, trace_key
from runtime.llm.arrival import ON_ARRIVAL, Recorded
from runtime.llm.backends.ollama import OllamaBackend
from runtime.llm.call_records import arrived_row
from runtime.llm.gate import REQUEST_SENT
from runtime.llm.recorder import CallSpec, Channel, Hello
from runtime.llm.reply import ModelReply, ModelRequestError
from runtime.llm.text_stream import CONTINUE_FROM, ON_TEXT
from runtime.records import ModelCharge
from runtime.store.call_replies import CallReplies
from runtime.store.postgres.engines import create_db_engine
from runtime.store.store import Store

log = logging.getLogger(__name__)

#: How long the calls in flight may go on once the worker is gone (their answers are
#: recorded for its tasks' next delivery).
GRACE_SECONDS = 10.0
#: How long a thread may hold the interpreter lock while another waits for it. Python's
#: 5 ms made the loop wait for the charge and journal threads at each step of reading a
#: reply: in a burst of 240 answers within 0.1 s, a process-group kill lost 45 to 96% of
#: the answers sent 21 ms or more before it (3 runs); with 0.5 ms, 3 to 43%.
SWITCH_INTERVAL_SECONDS = 0.0005
#: The backends a recorder can build, by kind (:meth:`Backend.recorder_spec`).
BACKENDS: dict[str, Callable[[tuple[Any, ...]], OllamaBackend]] = {
    "ollama": OllamaBackend.from_spec}


class RecorderServer:
    """Serves one worker's requests over its socket (see the module doc)."""

    def __init__(self) -> None:
        self.channel = Channel(self._received)
        self._charges: ChargeWriter | None = None
        self._journal: Journal | None = None
        self._probe: asyncio.Future[None] | None = None
        self._engine: Engine | None = None
        self._backends: dict[tuple[str, tuple[Any, ...]], OllamaBackend] = {}
        self._calls: dict[int, asyncio.Task[None]] = {}
        #: Per call whose reply is being journaled: tells the worker of it (then).
        self._tell: dict[int, Callable[[], None]] = {}
        #: The worker said it stops: no grace for its calls in flight.
        self._stopping = False

    def send(self, message: object) -> None:
        """Send one message to the worker (dropped once the socket is closed)."""
        self.channel.send(message)

    def _received(self, message: Any) -> None:
        if isinstance(message, Hello):  # the first message: where rows are recorded
            self._engine = create_db_engine(message.database_url, pool_size=CHARGE_LANES,
                                            statement_timeout_ms=message.statement_timeout_ms)
            loop = asyncio.get_running_loop()
            self._journal = Journal(CallReplies(create_db_engine(
                message.database_url, pool_size=1,
                statement_timeout_ms=message.statement_timeout_ms)),
                lambda rows: loop.call_soon_threadsafe(self._charge, rows))
            # Connected now, not by the first reply of a burst (a connection's start-up
            # and the dialect's first queries took tens of milliseconds on its path).
            threading.Thread(target=_warm, args=(self._engine, CHARGE_LANES),
                             daemon=True, name="warm").start()
            trace = os.environ.get("RECORDER_TRACE_DIR")
            if trace:  # measuring (bench/recorder_lag.py)
                self._charges = traced = TracedWriter(Store(self._engine), trace)
                self._journal.traced = traced.journaled
                self._probe = asyncio.ensure_future(traced.probe())
            else:
                self._charges = ChargeWriter(Store(self._engine))
        elif message[0] == "call":
            self.start(message[1], message[2])
        elif message[0] == "cancel":
            self.cancel(message[1])
        elif message[0] == "stop":  # the worker stops (not dies): nobody waits for these
            self._stopping = True
            for task in list(self._calls.values()):
                task.cancel()

    def start(self, call_id: int, spec: CallSpec) -> None:
        """Start making one request (its messages go back as they come)."""
        task = asyncio.create_task(self._make(call_id, spec))
        self._calls[call_id] = task
        task.add_done_callback(lambda _: self._calls.pop(call_id, None))

    def cancel(self, call_id: int) -> None:
        """The worker gave the call up (a cancelled task): drop its request."""
        task = self._calls.get(call_id)
        if task is not None:
            task.cancel()

    async def _make(self, call_id: int, spec: CallSpec) -> None:
        backend = self._backends.get(spec.backend)
        if backend is None:
            backend = self._backends[spec.backend] = BACKENDS[spec.backend[0]](spec.backend[1])

        sent: list[ModelReply] = []
        #: Done once the worker was told of the reply (after its journal's commit).
        told = asyncio.get_running_loop().create_future()

        def arrived(reply: ModelReply, recorded: Recorded | None = None) -> None:
            assert self._charges is not None  # (Hello comes first)
            if isinstance(self._charges, TracedWriter):
                self._charges.arrived[trace_key(spec.row)] = time.time()
            row = arrived_row(spec.row, reply, spec.price, keep_text=spec.keep_text)
            sent.append(reply)

            def tell() -> None:
                self.send(("arrived", call_id, reply, row))
                if not told.done():
                    told.set_result(None)

            self._tell[call_id] = tell
            if self._journal is not None:  # durable first; then handed on and charged
                self._journal.put(row, call_id)
            else:
                self._charge([(row, call_id)])

        ON_ARRIVAL.set(arrived)  # (this task's own context)
        REQUEST_SENT.set(lambda: self.send(("sent", call_id)))
        ON_TEXT.set((lambda text: self.send(("text", call_id, text))) if spec.stream else None)
        CONTINUE_FROM.set(spec.prefix)
        tools = {"tools": spec.tools} if spec.tools else {}
        try:
            reply = await backend.achat(spec.model, spec.messages, spec.schema,
                                        spec.max_tokens, route=spec.route, think=spec.think,
                                        **tools)
        except asyncio.CancelledError:
            self._tell.pop(call_id, None)
            raise
        except Exception as exc:
            if sent:  # (a reply that does not fit: the worker has its row first)
                await told
            self.send(("error", call_id, portable(exc)))
        else:  # (None: the reply that arrived, sent already)
            if sent:
                await told
            self.send(("done", call_id, None if sent and sent[0] is reply else reply))

    def _charge(self, rows: list[tuple[ModelCharge, int]]) -> None:
        """Queue the charges of replies journaled (on the loop); each call told when written."""
        assert self._charges is not None
        loop = asyncio.get_running_loop()
        for row, call_id in rows:
            tell = self._tell.pop(call_id, None)
            if tell is not None:  # the worker gets the reply once it is durable
                tell()
            written = self._charges.enqueue(row, loop)
            written.add_done_callback(functools.partial(self._written, call_id))

    def _written(self, call_id: int, future: asyncio.Future[bool]) -> None:
        if future.cancelled():
            outcome: object = ModelRequestError("the recorder stopped before the row's write")
        elif future.exception() is not None:
            outcome = portable(future.exception())  # type: ignore[arg-type]
        else:
            outcome = future.result()
        self.send(("written", call_id, outcome))

    async def finish(self) -> None:
        """The worker is gone: let the calls in flight finish (bounded), then drop them.

        A worker that died gets :data:`GRACE_SECONDS` for its calls' answers to come and
        be recorded; one that said it stops gets none (its calls were cancelled).
        """
        calls = list(self._calls.values())
        if calls:
            grace = 0.0 if self._stopping else GRACE_SECONDS
            _, late = await asyncio.wait(calls, timeout=grace) if grace else (set(), set(calls))
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for backend in self._backends.values():
            await backend.aclose()
        if self._journal is not None:
            await asyncio.to_thread(self._journal.close)
            await asyncio.sleep(0)  # its last batch's charges are queued (_charge)
        if self._charges is not None:
            await asyncio.to_thread(self._charges.close)  # writes what it holds
        self.channel.close()
        if self._engine is not None:
            self._engine.dispose()


class Journal:
    """A thread that journals the replies queued to it (:class:`CallReplies`), in batches.

    What arrived while its last INSERT was in flight is the next one: a burst of replies
    is a few statements, each committed at once, nothing locked but the rows' own. Then
    the batch goes to ``then`` (the replies' charges: they update the tasks and wait for
    their tree's clock, so they come after, not beside, the write that makes a reply
    durable). A batch that fails is logged and charged all the same: the charges record
    the replies as before.
    """

    def __init__(self, replies: CallReplies,
                 then: Callable[[list[tuple[ModelCharge, int]]], object]) -> None:
        self.replies = replies
        self._then = then
        self._queue: queue.SimpleQueue[tuple[ModelCharge, int] | None] = queue.SimpleQueue()
        self._conn: Connection | None = None
        #: Told of each batch written (start, end, rows): ``RECORDER_TRACE_DIR``'s trace.
        self.traced: Callable[[float, float, list[ModelCharge]], None] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="journal")
        self._thread.start()

    def put(self, row: ModelCharge, call_id: int) -> None:
        """Queue one reply's row, of the recorder's call ``call_id`` (from any thread)."""
        self._queue.put((row, call_id))

    def close(self) -> None:
        """Journal what is queued, then stop the thread (and drop its engine)."""
        self._queue.put(None)
        self._thread.join()
        self.replies.engine.dispose()

    def _run(self) -> None:
        try:  # connected before the first reply comes
            self._conn = self.replies.engine.connect()
        except Exception as exc:
            log.warning("the journal's connection failed", extra={"error": str(exc)})
        closing = False
        while not closing:
            first = self._queue.get()
            batch = [] if first is None else [first]
            closing = first is None
            while not closing:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                else:
                    batch.append(item)
            if batch:
                self._write(batch)
        if self._conn is not None:
            self._conn.close()

    def _write(self, batch: list[tuple[ModelCharge, int]]) -> None:
        started = time.time()
        rows = [row for row, _ in batch]
        try:  # on a connection of its own, kept (no pool check-out per batch)
            if self._conn is None or self._conn.invalidated or self._conn.closed:
                self._conn = self.replies.engine.connect()
            self.replies.journal(rows, self._conn)
        except Exception as exc:  # the charges follow: they record the replies as before
            log.warning("a batch of replies was not journaled",
                        extra={"size": len(batch), "error": str(exc)})
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        try:
            self._then(batch)
        except RuntimeError:  # the loop is closed: the process ends
            log.warning("replies journaled after the recorder's loop ended were not charged",
                        extra={"size": len(batch)})
        if self.traced is not None:
            self.traced(started, time.time(), rows)


def _warm(engine: Engine, connections: int) -> None:
    """Open ``connections`` of ``engine``'s pool now (the charge writer's lanes use them)."""
    try:
        held = [engine.connect() for _ in range(connections)]
    except Exception as exc:  # the lanes connect when they need to
        log.warning("the charge writer's connections failed", extra={"error": str(exc)})
        return
    for conn in held:
        conn.close()


def portable(exc: BaseException) -> BaseException:
    """``exc`` as it can cross to the worker (pickled), or a plain error saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return ModelRequestError(f"{type(exc).__name__}: {exc}")
    return exc


async def serve(fd: int) -> None:
    """Serve the worker on socket ``fd`` until it closes it (see the module doc)."""
    server = _TO_WORKER.server = RecorderServer()
    await asyncio.get_running_loop().create_connection(
        lambda: server.channel, sock=socket.socket(fileno=fd))
    await server.channel.closed
    await server.finish()


class _ToWorker(logging.Handler):
    """Sends this process's warnings to the worker, which logs them as its own.

    The recorder's standard streams are closed: a worker's output pipe must end when the
    worker does, not when its recorder has finished.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.server: RecorderServer | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.server is not None:
            try:  # (from any thread: the channel hands it to its loop)
                self.server.send(("log", 0, record.levelno, record.getMessage()))
            except RuntimeError:  # the loop has ended: nobody is left to tell
                self.handleError(record)


_TO_WORKER = _ToWorker()


def main(argv: list[str]) -> int:
    """Run the recorder on the socket whose descriptor is ``argv[0]``."""
    logging.getLogger().addHandler(_TO_WORKER)
    logging.getLogger().setLevel(logging.WARNING)
    # The loop, its journal and the charge writer's lanes share one interpreter lock: a
    # thread that wants it back waits for the holder's switch interval (5 ms by default),
    # and a reply's path takes it back many times (module doc: SWITCH_INTERVAL_SECONDS).
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    asyncio.run(serve(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
