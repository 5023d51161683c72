"""Chaos: people answer questions while PostgreSQL restarts, and each answer counts once.

``QUESTIONS`` questions to ``human``; ``CLIENTS`` clients (threads, each with the store
as the CLI and the API use it) answer every one, in their own orders, while the server
is restarted once in the middle. Each answer is an operation of the test's history: ``ok``
when the store said it applied it, ``fail`` when it refused (already answered: the 409 of
the API, exit 2 of the CLI), ``info`` when the database went away before the client was
told (the commit may or may not have landed). A last pass answers what is still open.

Then the audit's checker (promise 6): every question answered exactly once, by at most
one client told ``ok`` (at most one more of unknown outcome), a refused answer changed
nothing; and every task has one terminal event.
"""

from __future__ import annotations

import random
import threading
import uuid

import pytest

from runtime.audit.history import Recorder
from runtime.store.rows import NewTask
from runtime.store.steering.types import SteeringRefused
from runtime.store.store import Store
from tests.chaos.helpers import ServerControl, assert_audited, wait_until
from tests.factories import terminal_event_counts

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

QUESTIONS = 60
CLIENTS = 4
RESTART_AFTER_ANSWERS = QUESTIONS // 3


def _answer_all(store: Store, rec: Recorder, client: str, ids: list[uuid.UUID],
                answered: list[int]) -> None:
    for tid in ids:
        index = rec.invoke("answer", {"task": str(tid), "answer": client}, client)
        try:
            store.steering.answer(tid, {"text": client}, actor=client)
        except SteeringRefused as exc:
            rec.complete(index, "fail", {"status": 409, "error": str(exc)[:200]}, "answer",
                         client)
        except Exception as exc:  # the server went away: the client cannot know
            rec.complete(index, "info", {"error": f"{type(exc).__name__}"}, "answer", client)
        else:
            rec.complete(index, "ok", {"changed": True}, "answer", client)
            answered.append(1)


def test_answers_racing_a_server_restart_count_once(
        store: Store, server_ctl: ServerControl | None, history: Recorder) -> None:
    if server_ctl is None:
        pytest.skip("this test server cannot be restarted from here")
    ids = [store.tasks.submit(NewTask("human", "question", {"question": f"go ahead {i}?"}))[0]["id"]
           for i in range(QUESTIONS)]
    rng = random.Random()
    answered: list[int] = []
    clients = []
    for n in range(CLIENTS):
        order = list(ids)
        rng.shuffle(order)
        clients.append(threading.Thread(target=_answer_all, name=f"client-{n}", daemon=True,
                                        args=(store, history, f"client-{n}", order, answered)))
    for c in clients:
        c.start()
    wait_until(lambda: len(answered) >= RESTART_AFTER_ANSWERS or
               not any(c.is_alive() for c in clients), 60, "the first answers")
    server_ctl.restart(0.5)
    for c in clients:
        c.join(120)
    still_open = [t for t in ids if store.reads.get(t)["status"] == "pending"]
    _answer_all(store, history, "last-pass", still_open, answered)
    print(f"\nanswers: {len(answered)} applied of {QUESTIONS} questions by {CLIENTS} "
          f"clients; {len(still_open)} left open after the restart")
    assert all(store.reads.get(t)["status"] == "done" for t in ids)
    assert {t: n for t, n in terminal_event_counts(store).items() if n != 1} == {}
    assert_audited(store, history)
