"""A dead worker is noticed by PostgreSQL, not after its lease (issue 44, SPEC section 15).

Store level, with real sessions: each "worker" is a :class:`LivenessSession` (its lock
and its ``worker_sessions`` row on a connection of its own) plus tasks claimed under its
name with a 60 s lease. A session ended by ``pg_terminate_backend`` (what PostgreSQL does
when the process dies) gets its tasks taken back by the next dead-owner pass, long before
the lease; a live session's tasks are never taken; the old token is refused. A server
restart ends every session: then nothing is taken by session loss alone (its own
embedded server, so no other test's server is restarted).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from runtime.store.postgres import embedded, engines, migrations, urls
from runtime.store.rows import RunOutcome, TaskRow
from runtime.store.sessions import LivenessSession
from runtime.store.store import Store
from tests.chaos.helpers import server_control
from tests.factories import submit
from tests.support import wait_until

LEASE_SECONDS = 60.0


def _leased(store: Store, owner: str, n: int) -> list[TaskRow]:
    """``n`` tasks submitted and claimed by ``owner`` under a long lease."""
    agent = f"agent-{owner}"
    for i in range(n):
        submit(store, agent, {"goal": f"{owner} {i}"})
    claimed = store.claims.claim([agent], n, owner, LEASE_SECONDS)
    assert len(claimed) == n
    return claimed


def _rows(store: Store, sql: str, **params: Any) -> list[Any]:
    with store.engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params).all())


def _held(store: Store, owner: str) -> int:
    return len(_rows(store, "SELECT id FROM tasks WHERE lease_owner = :o "
                            "AND lease_token IS NOT NULL", o=owner))


def _terminate(url: str, pid: int) -> None:
    """End one backend as PostgreSQL does when its client process dies."""
    with psycopg.connect(urls.libpq_url(url), autocommit=True) as conn:
        assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)


@pytest.fixture
def sessions(store: Store) -> Iterator[list[LivenessSession]]:
    made: list[LivenessSession] = []
    yield made
    for s in made:
        s.close()


def _session(store: Store, made: list[LivenessSession], owner: str) -> LivenessSession:
    s = LivenessSession(store.engine, owner)
    assert s.register() is not None
    made.append(s)
    return s


def test_a_dead_session_s_tasks_come_back_long_before_the_lease(
        store: Store, db_url: str, sessions: list[LivenessSession]) -> None:
    dead = _session(store, sessions, "w-dead")
    live = _session(store, sessions, "w-live")
    doomed = _leased(store, "w-dead", 3)
    kept = _leased(store, "w-live", 2)
    assert store.hygiene.reap_dead(3).ids == ()  # both alive: nothing taken

    assert dead.registration is not None
    _terminate(db_url, dead.registration.backend_pid)
    taken = wait_until(lambda: store.hygiene.reap_dead(3).ids, 10.0, "the dead owner's tasks back")

    assert sorted(taken) == sorted(t.id for t in doomed)
    assert _held(store, "w-dead") == 0 and _held(store, "w-live") == 2
    statuses = {r.status for r in _rows(store, "SELECT status FROM tasks WHERE id = ANY(:i)",
                                        i=[t.id for t in doomed])}
    assert statuses == {"pending"}
    events = _rows(store, "SELECT task_id, from_status, to_status, worker, detail, lease_token "
                          "FROM task_events WHERE task_id = ANY(:i) AND to_status = 'pending' "
                          "AND from_status = 'running'", i=[t.id for t in doomed])
    assert {(e.worker, e.detail) for e in events} == {
        ("reaper", "released: its worker's session ended on delivery 1")}
    assert {e.lease_token for e in events} == {t.lease_token for t in doomed}
    # Fencing as before: the dead worker's late outcome matches no row.
    late = store.transitions.finish_running([RunOutcome(doomed[0].id, doomed[0].lease, "done",
                                                        result={"late": True})], "w-dead")
    assert late.applied == [] and late.stale == [doomed[0].id]
    # The dead owner holds nothing now: the next pass forgets its row; the live one stays.
    store.hygiene.reap_dead(3)
    owners = {r.owner for r in _rows(store, "SELECT owner FROM worker_sessions")}
    assert owners == {"w-live"}
    assert live.ensure() is not None and _held(store, "w-live") == len(kept)


def test_a_session_that_reconnects_registers_again(
        store: Store, db_url: str, sessions: list[LivenessSession]) -> None:
    s = _session(store, sessions, "w-blip")
    assert s.registration is not None
    first = s.registration.backend_pid
    _terminate(db_url, first)
    with pytest.raises(sa.exc.DBAPIError) as broke, s.connection.begin():
        s.connection.execute(sa.text("SELECT 1"))
    s.failed(broke.value)
    again = s.ensure()
    assert again is not None and again.backend_pid != first
    _leased(store, "w-blip", 1)
    assert store.hygiene.reap_dead(3).ids == ()
    row = _rows(store, "SELECT backend_pid FROM worker_sessions WHERE owner = 'w-blip'")
    assert [r.backend_pid for r in row] == [again.backend_pid]


def test_a_poisoned_task_s_parent_hears_of_it(
        store: Store, db_url: str, sessions: list[LivenessSession]) -> None:
    dead = _session(store, sessions, "w-poison")
    (task,) = _leased(store, "w-poison", 1)
    taken = store.hygiene.reap_dead(1)  # max_delivery 1: the first delivery was the last
    assert taken.ids == ()
    assert dead.registration is not None
    _terminate(db_url, dead.registration.backend_pid)
    wait_until(lambda: store.hygiene.reap_dead(1).poisoned, 10.0, "the task poisoned")
    row = store.reads.get(task.id)
    assert row["status"] == "failed" and row["error"].startswith("poison: delivered 1 times")


@pytest.fixture
def own_server(open_tmp: Path) -> Iterator[str]:
    """A migrated database on an embedded server of this test's own (it is restarted)."""
    server = embedded.embedded_server(open_tmp / "pgdata")
    url = urls.sqlalchemy_url(server.get_uri())
    name = f"orgchart_live_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(urls.libpq_url(url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
    target = sa.engine.make_url(url).set(database=name).render_as_string(hide_password=False)
    migrations.upgrade(target)
    try:
        yield target
    finally:
        server.cleanup()


def test_a_restart_takes_nothing_back_by_session_loss_alone(own_server: str) -> None:
    store = Store(engines.create_db_engine(own_server, pool_size=2))
    s = LivenessSession(store.engine, "w-restart")
    try:
        assert s.register() is not None
        held = _leased(store, "w-restart", 3)
        ctl = server_control(own_server)
        assert ctl is not None and ctl.kind == "embedded"
        ctl.restart()
        # Every session ended with the server, the lock too; the row names the old start.
        assert wait_until(lambda: _try_reap(store), 30.0, "the server back") == ((),)
        assert _held(store, "w-restart") == len(held)
        # The worker reconnects and registers again; then it dies: taken back at once.
        s.failed(sa.exc.DBAPIError("gone", None, Exception("gone"), connection_invalidated=True))
        again = s.ensure()
        assert again is not None
        _terminate(own_server, again.backend_pid)
        taken = wait_until(lambda: store.hygiene.reap_dead(3).ids, 10.0, "the tasks back")
        assert sorted(taken) == sorted(t.id for t in held)
    finally:
        s.close()
        store.dispose()


def _try_reap(store: Store) -> tuple[tuple[uuid.UUID, ...]] | None:
    """One dead-owner pass once the server answers (None while it does not)."""
    try:
        return (store.hygiene.reap_dead(3).ids,)
    except sa.exc.DBAPIError:
        return None
