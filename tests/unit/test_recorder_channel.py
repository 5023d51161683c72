"""The recorder's channel: messages sent from other threads than its loop's arrive too.

The recorder process logs its writer threads' warnings to the worker through the channel.
A send from such a thread once left its message queued with no flush scheduled, and every
later message of the loop queued behind it: the worker never heard of a reply again (seen
as a stalled fleet after a failover in tests/ha/test_failover.py).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

from runtime.llm.recorder import Channel


def test_a_message_sent_from_another_thread_arrives_and_the_loop_keeps_sending() -> None:
    async def scenario() -> list[Any]:
        ours, theirs = socket.socketpair()
        received: list[Any] = []
        got_three = asyncio.get_running_loop().create_future()

        def on_message(message: Any) -> None:
            received.append(message)
            if len(received) == 3 and not got_three.done():
                got_three.set_result(None)

        loop = asyncio.get_running_loop()
        sender = Channel(lambda _: None)
        await loop.create_connection(lambda: sender, sock=ours)
        reader = Channel(on_message)
        await loop.create_connection(lambda: reader, sock=theirs)

        thread = threading.Thread(target=sender.send, args=(("log", "from a thread"),))
        thread.start()
        await asyncio.to_thread(thread.join)
        sender.send(("arrived", 1))
        sender.send(("done", 1))
        await asyncio.wait_for(got_three, 10)
        sender.close()
        reader.close()
        return received

    received = asyncio.run(scenario())
    assert ("log", "from a thread") in received
    assert received[-2:] == [("arrived", 1), ("done", 1)] or \
        received[:2] == [("arrived", 1), ("done", 1)]
