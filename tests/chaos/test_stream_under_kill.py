"""Chaos: a worker SIGKILLed while its calls stream; the text is never recorded twice.

``TASKS`` ``spender`` tasks (one free-text model call each) run on one ``orgchart
worker`` against the loopback fake Ollama, which streams every reply in pieces of
``PIECE_CHARS`` characters ``PIECE_SECONDS`` apart (about two seconds a reply). Once
every call has text recorded and none has its reply yet, the worker is SIGKILLed with its
recorder process (its process group: a worker killed alone has its recorder finish and
record the replies, and nothing is continued; tests/chaos/test_durable_on_arrival.py);
a new one takes the tasks over (short leases) and finishes them.

What must hold (issue 47): every call cut off continues from its recorded text on its
next delivery (Ollama: the text as the assistant's last message), in the same attempt,
so each call's pieces put together are its reply exactly once; nothing is stored twice;
the text generated again (what the dead worker had received after its last recorded
piece) is at most one flush window of the stream; every task ends ``done`` and
``orgchart audit`` finds no violation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from runtime.store.store import Store
from tests.chaos.helpers import (
    Fleet,
    assert_audited,
    cli_env,
    status_counts,
    unfinished,
    wait_until,
)
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

TASKS = 20
PIECE_CHARS = 8
PIECE_SECONDS = 0.02
REPLY = ("Durable streams keep every piece of a reply in the database as it comes, "
         "so a reader that joins late sees it from the start, and a worker that dies "
         "mid-reply hands the next one the text it had, to go on from there. ") * 2
LEASE_SECONDS = 2
FLUSH_SECONDS = 0.1


def _texts(store: Store) -> list[dict[str, object]]:
    """Per call: its attempts, its text put together (last attempt), its reply, tokens."""
    with store.engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text("""
            SELECT c.task_id, count(DISTINCT c.attempt) AS attempts,
                   count(DISTINCT c.lease_token) AS deliveries,
                   string_agg(c.text, '' ORDER BY c."offset") AS text,
                   sum(char_length(c.text)) = max(c."offset" + char_length(c.text))
                       AS contiguous,
                   (SELECT m.response FROM model_calls m
                    WHERE m.task_id = c.task_id AND m.phase = 'run' AND m.call_index = 0
                      AND NOT m.replayed AND m.error IS NULL) AS reply
            FROM call_text c
            WHERE c.phase = 'run' AND c.call_index = 0
            GROUP BY c.task_id""")).mappings()]


def _recorded_chars(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        return {str(r.task_id): int(r.chars) for r in conn.execute(sa.text(
            "SELECT task_id, sum(char_length(text)) AS chars FROM call_text "
            "WHERE phase = 'run' GROUP BY task_id"))}


def test_a_worker_killed_mid_stream_leaves_text_that_the_next_one_continues(
        store: Store, fake_ollama: FakeOllama,
        make_fleet: Callable[[list[str]], Fleet]) -> None:
    fake_ollama.reply_text = REPLY
    fake_ollama.piece_chars = PIECE_CHARS
    fake_ollama.piece_delay_seconds = PIECE_SECONDS
    store.tasks.submit_many("spender", "task", [{"goal": f"stream {i}"} for i in range(TASKS)])
    fleet = make_fleet(["--agents-module", "tests.chaos.agents", "--agents", "spender,judge",
                        "--lease-seconds", str(LEASE_SECONDS)])
    fleet.env = cli_env(fleet.env, ORGCHART_LLM__BACKEND="ollama",
                        ORGCHART_OLLAMA__URL=fake_ollama.url,
                        ORGCHART_OLLAMA__MAX_PARALLEL="100",
                        ORGCHART_OLLAMA__CLOUD_MAX_PARALLEL="100",
                        ORGCHART_STREAMING__FLUSH_SECONDS=str(FLUSH_SECONDS))
    first = fleet.start(new_session=True)
    wait_until(lambda: len(_recorded_chars(store)) >= TASKS
               and min(_recorded_chars(store).values()) >= 4 * PIECE_CHARS, 60,
               "every call to have text recorded", interval=0.01)
    assert not fake_ollama.sent_log, "a reply was complete before the kill"
    kill = time.time()
    fleet.sigkill(first, group=True)
    at_kill = _recorded_chars(store)
    fleet.start()
    wait_until(lambda: unfinished(store) == 0, 120,
               f"every task to finish; now {dict(status_counts(store))}")
    assert status_counts(store) == {"done": TASKS}
    calls = _texts(store)
    assert len(calls) == TASKS
    for call in calls:
        # One attempt, continued by the second delivery: its pieces are the reply, once.
        assert call["attempts"] == 1 and call["deliveries"] == 2, call
        assert call["contiguous"] and call["text"] == call["reply"] == REPLY, call
    # What the dead worker had received after its last recorded piece, per call: the
    # text made again. At most one flush window of the stream (plus a piece in flight).
    continued = dict(fake_ollama.continued)
    assert len(continued) == TASKS
    received: dict[str, int] = {}
    for user, at, chars in fake_ollama.piece_log:
        if at <= kill:
            received[user] = received.get(user, 0) + chars
    window = (FLUSH_SECONDS / PIECE_SECONDS + 2) * PIECE_CHARS
    again = {user: received.get(user, 0) - start for user, start in continued.items()}
    print(f"\nrecorded at the kill: {sorted(at_kill.values())} chars; made again after "
          f"it: {sorted(again.values())} chars (window {window:.0f})")
    assert max(again.values()) <= window
    assert not fleet.unexpected_exits()
    assert_audited(store, fleet.recorder)
