"""The store against a server that goes away: pool discard, in-doubt commits, no double write.

A failover is simulated on one real server: a pooled connection that answers read-only
(SQLSTATE 25006, as a demoted primary does), a COMMIT whose connection is killed under it.
"""

from __future__ import annotations

import time
import uuid
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from runtime.engine.charges import ChargeWriter
from runtime.store.postgres import engines, failover, retry, urls
from runtime.store.rows import ModelCharge, NewTask
from runtime.store.store import Store
from runtime.wiring import submit_root
from tests.factories import submit


def _kill(db_url: str, pid: int) -> None:
    with psycopg.connect(urls.libpq_url(db_url), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


def test_a_read_only_answer_discards_the_whole_pool(store: Store) -> None:
    # Two pooled connections that now point at a "standby": both answer read-only.
    conns = [store.engine.connect() for _ in range(2)]
    for conn in conns:
        conn.exec_driver_sql("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        conn.commit()
    for conn in conns:
        conn.close()
    with pytest.raises(sa.exc.DBAPIError) as info:
        submit(store)
    assert failover.sqlstate(info.value) == "25006"
    assert failover.is_failover_error(info.value)
    # The sibling was discarded too: the retry gets a fresh (writable) connection.
    task = submit(store)
    assert store.reads.get(task["id"])["status"] == "pending"


def test_a_commit_whose_connection_dies_is_in_doubt(store: Store, db_url: str) -> None:
    with pytest.raises(sa.exc.DBAPIError) as info, store.database.transaction() as conn:
        conn.execute(sa.text("SELECT 1"))
        _kill(db_url, conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
    assert failover.in_doubt(info.value)
    with pytest.raises(sa.exc.DBAPIError) as info, store.database.transaction() as conn:
        _kill(db_url, conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        conn.execute(sa.text("SELECT 1"))  # fails before any COMMIT: not in doubt
    assert failover.is_failover_error(info.value) and not failover.in_doubt(info.value)
    assert store.ping()  # and the pool recovers


class _CommitThenBreak:
    """A store or part whose named methods commit, then raise an in-doubt error (``times``)."""

    def __init__(self, store: Any, names: set[str], times: int = 1) -> None:
        self._store, self._names, self.left = store, names, times

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._store, name)
        if name not in self._names:
            return real

        def call(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            if self.left > 0:
                self.left -= 1
                exc = sa.exc.OperationalError("COMMIT", {}, psycopg.OperationalError(
                    "server closed the connection unexpectedly"))
                failover.mark_in_doubt(exc)
                raise exc
            return result

        return call


def _count(store: Store, sql: str, **params: Any) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text(sql), params).scalar_one())


def test_a_submit_whose_commit_was_in_doubt_returns_the_same_root(store: Store) -> None:
    flaky = _CommitThenBreak(store.tasks, {"submit"})
    new = NewTask(to_agent="echo", type="task", payload={"goal": "in doubt"})
    door = SimpleNamespace(tasks=flaky, reads=store.reads, engine=store.engine)
    task, created = submit_root(door, new, "cli", timeout=10)  # type: ignore[arg-type]
    assert created and flaky.left == 0
    assert _count(store, "SELECT count(*) FROM tasks") == 1
    assert store.reads.get(task["id"])["payload"] == {"goal": "in doubt"}


def test_a_submit_with_a_key_retried_by_another_process_returns_the_same_root(
        store: Store) -> None:
    new = NewTask(to_agent="echo", type="task", payload={"goal": "k"}, idempotency_key="k1")
    first, _ = submit_root(store, new, "cli", timeout=10)
    again, created = submit_root(store, new, "cli", timeout=10)
    assert again["id"] == first["id"] and not created
    assert _count(store, "SELECT count(*) FROM tasks") == 1


def test_a_submit_gives_up_with_one_line_naming_the_outage() -> None:
    dead = Store(engines.create_db_engine("postgresql://nobody@127.0.0.1:1,127.0.0.1:2/none",
                                     pool_size=1))
    new = NewTask(to_agent="echo", type="task", payload={"goal": "x"})
    with pytest.raises(failover.DatabaseUnavailable) as info:
        submit_root(dead, new, "cli", timeout=0.5)
    message = str(info.value)
    assert "127.0.0.1:1,127.0.0.1:2" in message and "nothing was submitted" in message
    assert "\n" not in message


def _charge(row: Any, n: int) -> ModelCharge:
    return ModelCharge(task_id=row.id, lease_token=row.lease_token, attempt=1, call_index=n,
                       backend="test", route="local", route_reason="test", model="m",
                       prompt="p", response="r", prompt_tokens=10, completion_tokens=0,
                       duration_seconds=0.0, cost_usd=Decimal("0.01"), position=str(n))


def test_charges_whose_commit_was_in_doubt_are_not_charged_twice(store: Store) -> None:
    submit(store)
    (row,) = store.claims.claim(["echo"], 1, "w", 30)
    flaky = _CommitThenBreak(store.spend, {"charge_many"})
    writer = ChargeWriter(SimpleNamespace(spend=flaky))  # type: ignore[arg-type]
    try:
        futures = [writer.submit(_charge(row, n)) for n in range(3)]
        assert [f.result(timeout=30) for f in futures] == [True, True, True]
    finally:
        writer.close()
    assert writer.resolved_in_doubt == 3
    assert _count(store, "SELECT count(*) FROM model_calls") == 3
    assert _count(store, "SELECT own_tokens FROM tasks WHERE id = :id", id=row.id) == 30


def test_charges_that_failed_before_their_commit_are_written_again(store: Store) -> None:
    submit(store)
    (row,) = store.claims.claim(["echo"], 1, "w", 30)
    real, failures = store.spend.charge_many, []

    def break_first(charges: Any) -> Any:
        if not failures:
            failures.append(1)
            raise sa.exc.OperationalError("INSERT", {}, psycopg.OperationalError("gone"))
        return real(charges)

    store.spend.charge_many = break_first  # type: ignore[method-assign]
    writer = ChargeWriter(store)
    try:
        assert writer.charge(_charge(row, 0)) is True
    finally:
        writer.close()
    assert failures and writer.resolved_in_doubt == 0
    assert _count(store, "SELECT count(*) FROM model_calls WHERE task_id = :id", id=row.id) == 1


def test_unrelated_failures_are_not_retried(store: Store) -> None:
    calls: list[uuid.UUID] = []

    def refuse() -> None:
        calls.append(uuid.uuid4())
        raise sa.exc.IntegrityError("INSERT", {}, psycopg.errors.lookup("23505")("dup"))

    with pytest.raises(sa.exc.IntegrityError):
        retry.retry(refuse, timeout=10)
    assert len(calls) == 1


def test_every_connection_carries_the_network_options(store: Store) -> None:
    with store.engine.connect() as conn:
        shown = conn.execute(sa.text("SHOW idle_in_transaction_session_timeout")).scalar()
    assert shown == "10s"
    url = store.engine.url.render_as_string(hide_password=False)
    with psycopg.connect(urls.libpq_url(url)) as raw:  # the LISTEN connection's way
        row = raw.execute("SHOW idle_in_transaction_session_timeout").fetchone()
    assert row is not None and row[0] == "10s"


def test_a_session_stuck_in_a_transaction_lets_its_locks_go(db_url: str) -> None:
    # A worker cut off between its UPDATE and its COMMIT: the server ends the session.
    stuck = Store(engines.create_db_engine(db_url, pool_size=1, options=urls.ConnectionOptions(
        idle_in_transaction_timeout_ms=300)))
    other = Store(engines.create_db_engine(db_url, pool_size=1))
    try:
        task = submit(other)
        conn = stuck.engine.connect()
        conn.execute(sa.text("UPDATE tasks SET priority = 1 WHERE id = :id"), {"id": task["id"]})
        locked = "SELECT count(*) FROM (SELECT id FROM tasks WHERE id = :id " \
                 "FOR UPDATE SKIP LOCKED) x"
        assert _count(other, locked, id=task["id"]) == 0
        deadline = time.monotonic() + 30
        while _count(other, locked, id=task["id"]) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _count(other, locked, id=task["id"]) == 1
        assert other.reads.get(task["id"])["priority"] == task["priority"]  # rolled back
        with pytest.raises(sa.exc.DBAPIError):
            conn.commit()
        conn.close()
    finally:
        stuck.dispose()
        other.dispose()


def _pooled_engine(db_url: str, idle_seconds: float) -> sa.Engine:
    """One pooled connection, pinged at checkout once idle ``idle_seconds``."""
    engine = sa.create_engine(urls.with_options(db_url, engines.DEFAULT_OPTIONS), pool_size=1,
                              max_overflow=0)
    return failover.install(engines.ping_when_idle(engine, idle_seconds))


def _backend_pid(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


def _kill_and_wait(db_url: str, pid: int) -> None:
    _kill(db_url, pid)
    with psycopg.connect(urls.libpq_url(db_url), autocommit=True) as admin:
        deadline = time.monotonic() + 30
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                            (pid,)).fetchone() is not None:
            assert time.monotonic() < deadline, "the backend did not end"
            time.sleep(0.02)


def test_an_idle_connection_killed_in_the_pool_is_replaced_before_use(db_url: str) -> None:
    # The server restarted while the connection sat in the pool: the checkout's ping finds
    # it dead and connects again, so the first statement after the restart succeeds.
    engine = _pooled_engine(db_url, idle_seconds=0.0)
    try:
        first = _backend_pid(engine)
        _kill_and_wait(db_url, first)
        assert _backend_pid(engine) != first
    finally:
        engine.dispose()


def test_a_connection_in_steady_use_is_not_pinged(db_url: str) -> None:
    # Checked in a moment ago: no ping at checkout (the round trip a busy worker saves on
    # each transaction). A server gone since shows as a failover error on the statement,
    # which discards the pool, and the next checkout connects again.
    engine = _pooled_engine(db_url, idle_seconds=3600.0)
    try:
        first = _backend_pid(engine)
        _kill_and_wait(db_url, first)
        with pytest.raises(sa.exc.DBAPIError) as raised:
            _backend_pid(engine)
        assert failover.is_failover_error(raised.value)
        assert _backend_pid(engine) != first
    finally:
        engine.dispose()
