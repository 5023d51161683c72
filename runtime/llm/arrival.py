"""The moment a reply arrives: where the model layer records it, before anything else.

An answer is durable on arrival (SPEC section 15): the send stage
(:class:`runtime.llm.sending.Sender`) sets :data:`ON_ARRIVAL` around each request, and a
backend that reads replies off a socket (:mod:`runtime.llm.backends.ollama`) calls
:func:`reply_arrived` with the parsed reply the moment it has it, before it checks the
reply against the call's schema. The hook queues the reply's ``model_calls`` row to the
charge writer (a thread-safe queue put: nothing waits) and returns; validation, repair,
the budget's settlement and the agent come after. A backend that does not call it (the
offline one, a replay file, the embedded model) is recorded by the send stage as soon as
its ``achat`` returns, still before validation.

A server's replies are read and recorded by the recorder process
(:mod:`runtime.llm.recorder`): it queues the row to its own charge writer the moment the
reply is parsed, then tells this process, whose hook gets the row and the future of its
write (:data:`Recorded`) and queues nothing.

The hook runs on whatever thread read the reply (the worker's loop, or the model
layer's reply loop: :mod:`runtime.llm.reply_loop`); it must not touch a loop's objects.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future

from runtime.llm.reply import ModelReply
from runtime.records import ModelCharge

#: A reply's row as another process queued it, and the future of its write (True:
#: recorded; False: the lease was gone).
Recorded = tuple[ModelCharge, "Future[bool]"]

#: Set by the send stage around one request: records the request's reply when it arrives
#: (given the row when it is recorded already).
ON_ARRIVAL: contextvars.ContextVar[Callable[[ModelReply, Recorded | None], None] | None] = \
    contextvars.ContextVar("orgchart_on_arrival", default=None)


def reply_arrived(reply: ModelReply, recorded: Recorded | None = None) -> None:
    """Say that the current request's reply has arrived (parsed, not yet checked)."""
    hook = ON_ARRIVAL.get()
    if hook is not None:
        hook(reply, recorded)
