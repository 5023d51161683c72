"""Contract fixes of issue 12, each pinned by a test that failed before its fix."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
import sqlalchemy as sa

from runtime.store.postgres import engines, migrations
from runtime.store.queries import QUERIES, TEXT
from runtime.store.rows import RunOutcome
from runtime.store.store import Store
from tests.factories import events, parent_with_children


def test_retried_child_event_names_the_status_it_left(store: Store) -> None:
    parent, (failed, escalated) = parent_with_children(store, 2)
    first, second = store.claims.claim(["echo"], 2, "w", 30)
    by_id = {first["id"]: first, second["id"]: second}
    store.transitions.finish_running([
        RunOutcome(failed["id"], by_id[failed["id"]]["lease_token"], "failed", error="boom"),
        RunOutcome(escalated["id"], by_id[escalated["id"]]["lease_token"], "escalated",
                               error="why"),
    ], "w")
    (agg,) = store.claims.claim(["fanout"], 1, "w", 30)
    assert agg["id"] == parent["id"]
    assert store.transitions.retry_children(agg["id"], agg["lease_token"],
                                            [failed["id"], escalated["id"]], "w") == 2
    assert events(store, failed["id"])[-1] == ("failed", "pending")
    assert events(store, escalated["id"])[-1] == ("escalated", "pending")


def test_statement_timeout_cancels_a_long_statement(db_url: str) -> None:
    engine = engines.create_db_engine(db_url, pool_size=1, statement_timeout_ms=200)
    try:
        with engine.connect() as conn, pytest.raises(sa.exc.OperationalError,
                                                     match="statement timeout"):
            conn.execute(sa.text("SELECT pg_sleep(5)"))
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar() == "200ms"
    finally:
        engine.dispose()


def test_statement_timeout_zero_means_none(db_url: str) -> None:
    engine = engines.create_db_engine(db_url, pool_size=1, statement_timeout_ms=0)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar() == "0"
            conn.execute(sa.text("SELECT pg_sleep(0.3)"))
    finally:
        engine.dispose()


def test_the_channel_is_named_once_in_python_and_never_in_the_sql() -> None:
    from runtime.store.queries import QUERIES_FILE, TASKS_CHANNEL, WEBHOOKS_CHANNEL

    text = QUERIES_FILE.read_text(encoding="utf-8")
    assert TASKS_CHANNEL not in text and WEBHOOKS_CHANNEL not in text
    notifying = [name for name, sql in QUERIES.items() if "pg_notify(" in sql]
    assert len(notifying) >= 10
    for name in notifying:
        assert (f"pg_notify('{TASKS_CHANNEL}'" in QUERIES[name]
                or f"pg_notify('{WEBHOOKS_CHANNEL}'" in QUERIES[name]), name
    assert QUERIES["channel_listen_tasks"].endswith(f"\nLISTEN {TASKS_CHANNEL};")
    assert QUERIES["channel_listen_webhooks"].rstrip().endswith(f"\nLISTEN {WEBHOOKS_CHANNEL};")


def test_migration_lock_and_version_check_are_named_statements() -> None:
    import inspect

    source = inspect.getsource(migrations)
    assert "sa.text(\"SELECT" not in source and "pg_advisory" not in source
    for name in ("migration_lock_acquire", "migration_lock_release",
                 "migration_version_table_exists", "migration_version_get"):
        assert name in QUERIES


def test_prune_never_deletes_a_tree_whose_task_is_being_resolved(store: Store) -> None:
    parent, (child,) = parent_with_children(store, 1)
    (claimed,) = store.claims.claim(["echo"], 1, "w", 30)
    store.transitions.finish_running([RunOutcome(child["id"], claimed["lease_token"], "escalated",
                                                 error="needs a person")], "w")
    with store.database.transaction() as conn:  # the whole tree finished long ago
        conn.execute(sa.text("UPDATE tasks SET status = 'done', completed_at = now() - "
                             "interval '2 days' WHERE id = :id"), {"id": parent["id"]})
    # A person's `resolve --retry` holds its transaction open, the child already reopened.
    resolver = store.engine.connect()
    resolver.begin()
    resolver.execute(TEXT["task_lock_by_id"], {"id": child["id"]})
    resolver.execute(TEXT["task_resolve_escalated"], {
        "id": child["id"], "to_status": "pending", "reassign_to": None, "actor": "person",
        "detail": "resolved: retry", "error": None})
    pruned: list[tuple[int, int]] = []
    pruner = threading.Thread(target=lambda: pruned.append(store.reads.prune(dt.timedelta(days=1))))
    pruner.start()
    pruner.join(timeout=2.0)  # the fixed prune passes over a locked tree at once
    resolver.commit()
    resolver.close()
    pruner.join(timeout=30)
    assert pruned and pruned[0] == (0, 0)
    assert store.reads.get(child["id"])["status"] == "pending"
    assert store.reads.get(parent["id"])["status"] == "done"
    # Once nothing holds it, a still-unfinished tree is kept too.
    assert store.reads.prune(dt.timedelta(days=1)) == (0, 0)


def test_the_setting_reaches_the_stores_connections(db_url: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.config import DatabaseSettings, Settings
    from runtime.wiring import open_store

    for name in ("ORGCHART_DATABASE_URL", "DATABASE_URL"):  # the configured url must win
        monkeypatch.delenv(name, raising=False)

    store = open_store(Settings(database=DatabaseSettings(url=db_url, statement_timeout_ms=150)))
    try:
        with store.engine.connect() as conn:
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar() == "150ms"
    finally:
        store.dispose()
