"""The send stage: one request of a call, from its budget reservation to its charge.

:meth:`Sender.attempt` makes one request of a call (its
:class:`~runtime.llm.request.CallProgress`, which it writes: the reservation held, the
row on arrival, the requests made and their cost):

1. reserve: the request's estimated prompt tokens plus its completion cap are held in the
   task's budget (:meth:`runtime.budget.TaskBudget.reserve`, the cap shrunk to what is
   left, or :class:`~runtime.errors.BudgetExceeded`);
2. slot: its turn at its server (:class:`runtime.llm.server_slots.ServerSlots`);
3. send: through the start gate (:class:`runtime.llm.gate.CallGate`: no request for a
   cancelled task or in a paused tree) to the backend (a server's, from the reply loop
   :mod:`runtime.llm.reply_loop`, made by the recorder process: :mod:`runtime.llm.recorder`);
4. record: the reply's row is queued to the ledger's writer the moment the reply arrives
   (:mod:`runtime.llm.arrival`; :meth:`runtime.llm.charging.Charger.arrived`; a server's
   reply to the recorder's own writer, in its process), before
   anything else looks at it: an answer is durable on arrival; with ``[streaming]`` on,
   the text streamed before it was buffered as it came (:mod:`runtime.llm.text_stream`)
   and its last piece is written at arrival, awaited beside the charge;
5. validate: the reply against the call's pydantic class (:func:`runtime.llm.repair.validated`);
6. charge: await the row's write, answered, or give it its error when the reply is bad
   (:class:`runtime.llm.charging.Charger`);

and settles the reservation with what was charged, whatever happened (a reply recorded
on arrival counts as charged unless its write was refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from decimal import Decimal
from typing import Any

from runtime.budget import Reservation, TaskBudget
from runtime.errors import LeaseLost
from runtime.llm.arrival import ON_ARRIVAL, Recorded
from runtime.llm.charging import Charger
from runtime.llm.gate import CallGate
from runtime.llm.recorder import CallSpec, Recorder
from runtime.llm.repair import validated
from runtime.llm.reply import Backend, BadModelReply, ModelReply, message_tokens
from runtime.llm.reply_loop import REPLY_LOOP
from runtime.llm.request import CallProgress
from runtime.llm.server_slots import Fair, ServerSlots
from runtime.llm.text_stream import CONTINUE_FROM, ON_TEXT, CallAttempts, TextSink, TextStream
from runtime.llm.token_meter import StopCheck

log = logging.getLogger(__name__)


class Sender:
    """Makes the requests of one task's calls, each reserved, slotted, gated and charged.

    Args:
        backend / slots / gate: where requests go, their turn, their start gate.
        budget / charger: the task's budget and the writer of its rows.
        fair / stopped: whose the requests are (fair order) and why they may not start.
        lease_token / lease_lost: the task's lease (fencing).
        text: where requests' streamed text is written (``[streaming]`` on), else None.
        continue_cut_off: a call cut off on an earlier delivery continues from its
            recorded text (``[streaming] continue_cut_off``) when the backend can.
        recorder: the recorder process a remote backend's requests go through (taken on
            first use: :meth:`runtime.llm.handle.LLMFactory.recorder`), or None.

    """

    def __init__(self, backend: Backend, slots: ServerSlots, gate: CallGate,
                 budget: TaskBudget, charger: Charger, fair: Fair, stopped: StopCheck,
                 lease_token: uuid.UUID, lease_lost: threading.Event,
                 text: TextSink | None = None, continue_cut_off: bool = True,
                 recorder: Callable[[], Recorder | None] = lambda: None) -> None:
        self._backend, self._slots, self._gate = backend, slots, gate
        self._budget, self._charger = budget, charger
        self._fair, self._stopped = fair, stopped
        self._lease_token, self._lease_lost = lease_token, lease_lost
        self._task_id = charger.rows.task_id
        #: A server's replies are read on the reply loop, not behind this loop's work.
        self._remote = backend.remote
        self._recorder = recorder
        self._text = text
        #: The backend continues a prefix (a call cut off is continued, not made again).
        self._continues = continue_cut_off and backend.continues_prefix
        #: Per call (its index): the last attempt its streams got in this delivery.
        self._text_calls: dict[int, CallAttempts] = {}

    async def attempt(self, call: CallProgress) -> tuple[ModelReply, Any]:
        """One request: reserve, slot, gate, send and record, validate, charge; settle.

        Its order, top to bottom (the module doc): the budget's reservation; the stream
        (and the recorded text a call cut off continues); the slot's ticket; the start
        gate, which sends it (from the reply loop, by the recorder process, for a
        server's); the reply recorded on arrival; validation; the charge; the settlement.
        """
        if self._lease_lost.is_set():
            raise LeaseLost(f"task {self._task_id}: lease lost; the model was not called")
        # Reserve (budget rule 3); the finally below settles with what was charged (rule 4).
        held = call.held = self._budget.reserve(
            message_tokens(call.conversation), call.request.max_tokens, call.routed.price)
        call.rows += 1
        call.arrival = None
        started = time.monotonic()
        charged_tokens, charged_usd = 0, Decimal(0)
        loop = asyncio.get_running_loop()
        try:
            try:
                stream, prefix = await self._open_stream(call)
                ticket = self._slots.ticket(call, self._fair, self._stopped)
                make = self._maker(call, held.completion_tokens, prefix, stream)

                async def sent() -> ModelReply:  # under the slot, once the gate let it
                    reply = await (REPLY_LOOP.run(make) if self._remote else make())
                    ticket.answered = True
                    return reply

                with self._hooks(call, stream, prefix, loop):  # arrival, text
                    # cancelled? paused? (gate.py), then sent
                    reply = await self._gate.send(self._task_id, ticket, sent,
                                                  lease_token=self._lease_token)
                ticket.settle(reply.prompt_tokens + reply.completion_tokens)  # its spend
                if call.arrival is None:  # a backend that does not say when it arrived
                    self._charger.arrived(call, reply, loop)
                if stream is not None and self._text is not None:
                    # Its last piece commits (beside the reply's row) before the call
                    # returns: every write the task makes after the call follows it (by
                    # txid), so a reader sees the text before the task's next transition.
                    await self._text.finished(stream)
                output = validated(reply, call.request.model_cls)  # the one validation
            except Exception as exc:
                spent = exc.reply if isinstance(exc, BadModelReply) else None
                charged_tokens, charged_usd = await self._charger.failed(
                    call, exc, spent, time.monotonic() - started)
                raise
            charged_tokens, charged_usd = await self._charger.answered(call, reply)
            return reply, output
        finally:
            call.held = None
            if call.arrival is not None:  # recorded on arrival: charged unless refused
                charged_tokens, charged_usd = call.arrival.charged
            self._settle(held, charged_tokens, charged_usd)

    def _settle(self, held: Reservation, tokens: int, usd: Decimal) -> None:
        """Settle a request's reservation with what it was charged (budget rule 4)."""
        settled = self._budget.settle(held, tokens, usd)
        if settled.over_tokens > 0:
            log.info("a request spent more than it reserved (the server counted more "
                     "prompt tokens than estimated)",
                     extra={"task_id": str(self._task_id), "over": settled.over_tokens})

    @contextlib.contextmanager
    def _hooks(self, call: CallProgress, stream: TextStream | None, prefix: str | None,
               loop: asyncio.AbstractEventLoop) -> Iterator[None]:
        """The request's hooks while it is sent: on arrival, on text, the text continued.

        On arrival (on the thread that read the reply, or told of it by the recorder
        process) the stream's last piece is written and the reply's row queued
        (:meth:`Charger.arrived`). A failed send ends the stream: what came before the
        failure is still written.
        """
        def arrived(reply: ModelReply, recorded: Recorded | None = None) -> None:
            if stream is not None:
                stream.end()
            if call.arrival is None:
                self._charger.arrived(call, reply, loop, recorded)

        recording = ON_ARRIVAL.set(arrived)
        streaming = ON_TEXT.set(None if stream is None else stream.add)
        continuing = CONTINUE_FROM.set(prefix)
        try:
            yield
        except BaseException:
            if stream is not None:
                stream.end()
            raise
        finally:
            CONTINUE_FROM.reset(continuing)
            ON_TEXT.reset(streaming)
            ON_ARRIVAL.reset(recording)

    def _maker(self, call: CallProgress, max_tokens: int, prefix: str | None,
               stream: TextStream | None) -> Callable[[], Awaitable[ModelReply]]:
        """What makes ``request``: the backend's ``achat``, or the recorder process's."""
        recorder = self._recorder() if self._remote else None
        if recorder is not None:  # made and recorded by the recorder process
            return functools.partial(recorder.achat, self._spec(
                call, max_tokens, prefix, stream is not None))
        tools = {"tools": call.request.tools} if call.request.tools else {}
        route = call.routed.route
        return functools.partial(
            self._backend.achat, route.model, call.conversation, call.request.json_schema,
            max_tokens, route=route.route, think=call.request.think, **tools)

    def _spec(self, call: CallProgress, max_tokens: int, prefix: str | None,
              stream: bool) -> CallSpec:
        """``request`` as the recorder process makes it (:mod:`runtime.llm.recorder`)."""
        backend = self._backend.recorder_spec()
        assert backend is not None  # (a recorder is given for such backends only)
        rows = self._charger.rows
        asked, route = call.request, call.routed.route
        return CallSpec(backend=backend, model=route.model,
                        messages=call.conversation, schema=asked.json_schema,
                        max_tokens=max_tokens, route=route.route,
                        think=asked.think, tools=asked.tools or (), prefix=prefix,
                        stream=stream, row=rows.template(call, call.kind),
                        price=call.routed.price, keep_text=rows.record)

    async def _open_stream(self, call: CallProgress) -> tuple[TextStream | None, str | None]:
        """The request's stream, and the recorded text it continues (None: from the start).

        A call cut off mid-generation on an earlier delivery (its text recorded, no reply
        ever arrived) is continued, not made again, when the backend can continue a
        prefix: only on a later delivery of the task (``delivery_count`` > 1: the first
        costs no read), the call's first request of it, free text (a schema's grammar and
        a tool round start over).
        """
        stream = self._stream(call)
        if (stream is None or self._text is None or not self._continues
                or self._charger.rows.attempt < 2  # the task's first delivery: nothing cut
                or call.rows != 1 or call.kind != "call"
                or call.request.json_schema is not None or call.request.tools):
            return stream, None
        try:
            found = await asyncio.to_thread(self._text.cut_off, self._task_id, stream.phase,
                                            call.request.call_index)
        except Exception as exc:  # the call is made whole rather than not at all
            log.warning("could not read a call's recorded text; it is made again whole",
                        extra={"task_id": str(self._task_id), "error": str(exc)})
            found = None
        if found is None:
            return stream, None
        attempt, text = found
        stream.resume(attempt, len(text))
        log.info("a call cut off mid-generation continues from its recorded text",
                 extra={"task_id": str(self._task_id), "call_index": call.request.call_index,
                        "attempt": attempt, "chars": len(text)})
        return stream, text

    def _stream(self, call: CallProgress) -> TextStream | None:
        """A new stream (a new attempt) for the request about to be sent, when streaming."""
        if self._text is None:
            return None
        attempts = self._text_calls.get(call.request.call_index)
        if attempts is None:
            attempts = self._text_calls[call.request.call_index] = CallAttempts()
        return self._text.open(self._task_id, self._lease_token, self._charger.rows.phase,
                               call.request.call_index, attempts)
