"""The journal of replies (``call_replies``): written on arrival, adopted once on a re-run.

A reply the recorder journaled whose charge never committed (the worker and its
recorder killed together) is adopted by the task's next delivery: recorded and charged
once, under the new lease. A reply whose charge committed, one whose request a later
delivery made again (a late worker's entry), and one offered under a lease that is gone
charge nothing more.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from decimal import Decimal

import sqlalchemy as sa

from runtime.store.call_replies import CallReplies
from runtime.store.rows import ModelCharge
from runtime.store.store import Store
from tests.factories import hand_over, submit


def _reply(task_id: uuid.UUID, token: uuid.UUID, tokens: int = 7, attempt: int = 1,
           position: str = "0") -> ModelCharge:
    return ModelCharge(task_id=task_id, lease_token=token, attempt=attempt, call_index=0,
                       backend="test", route="local", route_reason="test", model="m",
                       prompt="p", response="r", prompt_tokens=tokens, completion_tokens=1,
                       duration_seconds=0.1, cost_usd=Decimal(tokens + 1) / 1000,
                       position=position, request_hash="h")


def _running(store: Store) -> tuple[uuid.UUID, uuid.UUID]:
    task = submit(store)
    (row,) = store.claims.claim(["echo"], 1, "w-dead", 30)
    assert row.id == task["id"] and row.lease_token is not None
    return row.id, row.lease_token


def _state(store: Store, task_id: uuid.UUID) -> tuple[int, int, Decimal, int]:
    """Paid rows, the task's own tokens and dollars, and its journal rows."""
    with store.engine.connect() as conn:
        return tuple(conn.execute(sa.text("""
            SELECT (SELECT count(*) FROM model_calls WHERE task_id = :id AND NOT replayed),
                   t.own_tokens, t.own_usd,
                   (SELECT count(*) FROM call_replies WHERE task_id = :id)
            FROM tasks t WHERE t.id = :id"""), {"id": task_id}).one())


def test_a_journaled_reply_never_charged_is_adopted_once_under_the_new_lease(
        store: Store) -> None:
    replies = CallReplies(store.engine)
    task_id, dead = _running(store)
    assert replies.journal([_reply(task_id, dead)]) == 1  # then the recorder died
    assert _state(store, task_id) == (0, 0, Decimal(0), 1)
    new = hand_over(store, task_id)  # the dead worker's task taken back
    assert replies.adopt([(task_id, dead)]) == 0  # the old lease adopts nothing
    assert replies.adopt([(task_id, new)]) == 1
    assert _state(store, task_id) == (1, 8, Decimal("0.008"), 0)
    assert replies.adopt([(task_id, new)]) == 0  # once
    # The adopted row is on record as the charge would have written it: it is replayed.
    with store.engine.connect() as conn:
        row = conn.execute(sa.text(
            "SELECT response, error, attempt, position, request_hash FROM model_calls "
            "WHERE task_id = :id"), {"id": task_id}).one()
    assert tuple(row) == ("r", None, 1, "0", "h")


def test_a_reply_whose_charge_committed_is_not_adopted(store: Store) -> None:
    replies = CallReplies(store.engine)
    task_id, dead = _running(store)
    reply = _reply(task_id, dead)
    replies.journal([reply])
    assert store.spend.charge_many([reply]) == [True]
    new = hand_over(store, task_id)
    assert replies.adopt([(task_id, new)]) == 0
    assert _state(store, task_id) == (1, 8, Decimal("0.008"), 0)


def test_a_late_workers_entry_after_the_call_was_made_again_charges_nothing(
        store: Store) -> None:
    replies = CallReplies(store.engine)
    task_id, late = _running(store)
    second = hand_over(store, task_id)
    # The second delivery made the call again and was charged for it ...
    assert store.spend.charge_many([_reply(task_id, second, attempt=2)]) == [True]
    # ... then the first delivery's recorder journaled its own reply, late; its charge
    # is refused by the fence, and no later delivery adopts the entry.
    replies.journal([_reply(task_id, late)])
    assert store.spend.charge_many([_reply(task_id, late)]) == [False]
    third = hand_over(store, task_id)
    assert replies.adopt([(task_id, third)]) == 0
    assert _state(store, task_id) == (1, 8, Decimal("0.008"), 0)


def test_two_adopters_of_one_lease_charge_a_reply_once(store: Store) -> None:
    replies = CallReplies(store.engine)
    tasks = [_running(store) for _ in range(3)]
    for task_id, dead in tasks:
        replies.journal([_reply(task_id, dead), _reply(task_id, dead, position="1")])
    held = [(task_id, hand_over(store, task_id)) for task_id, _ in tasks]
    counts: list[int] = []
    start = threading.Barrier(4)

    def adopt() -> None:
        start.wait()
        counts.append(replies.adopt(held))

    threads = [threading.Thread(target=adopt) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(counts) == 6
    for task_id, _ in tasks:
        assert _state(store, task_id) == (2, 16, Decimal("0.016"), 0)


def test_a_batch_with_a_bad_reply_journals_the_others(store: Store) -> None:
    replies = CallReplies(store.engine)
    task_id, token = _running(store)
    bad = dataclasses.replace(_reply(task_id, token, position="1"), response="nul\x00")
    assert replies.journal([_reply(task_id, token), bad]) == 1
    assert _state(store, task_id)[3] == 1
