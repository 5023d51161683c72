"""The lease flag behaves as a ``threading.Event`` across threads (it is made lazily)."""

from __future__ import annotations

import threading
import time

from runtime.engine.worker.state import InFlight, LeaseFlag


def test_a_flag_is_an_event_that_starts_clear() -> None:
    flag = LeaseFlag()
    assert isinstance(flag, threading.Event)
    assert not flag.is_set()
    assert flag.wait(0.01) is False
    flag.set()
    assert flag.is_set() and flag.wait(0) is True
    flag.clear()
    assert not flag.is_set() and flag.wait(0.01) is False


def test_a_waiter_wakes_when_another_thread_sets_the_flag() -> None:
    flag, woke = LeaseFlag(), []
    waiters = [threading.Thread(target=lambda: woke.append(flag.wait(10))) for _ in range(4)]
    for t in waiters:
        t.start()
    time.sleep(0.05)  # they are waiting now (or about to: either way they must wake)
    flag.set()
    for t in waiters:
        t.join(5)  # a guard against a hang; wait(10) returns True only if it was set
    assert woke == [True] * 4


def test_set_racing_the_first_wait_is_never_lost() -> None:
    for _ in range(300):
        flag = LeaseFlag()
        setter = threading.Thread(target=flag.set)
        setter.start()
        assert flag.wait(5) is True
        setter.join()


def test_each_held_task_gets_a_flag_of_its_own() -> None:
    a, b = InFlight(row=None, kind="run"), InFlight(row=None, kind="run")  # type: ignore[arg-type]
    a.lease_lost.set()
    assert isinstance(a.lease_lost, LeaseFlag) and not b.lease_lost.is_set()
