"""Migrations: upgrade, downgrade, upgrade on an empty database; models agree."""

from __future__ import annotations

import psycopg
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from runtime.store.models import Base
from runtime.store.postgres import migrations, urls

SEED_COLUMNS = [
    ("id", "uuid"), ("parent_id", "uuid"), ("root_id", "uuid"), ("from_agent", "text"),
    ("to_agent", "text"), ("type", "text"), ("hypothesis_id", "uuid"), ("payload", "jsonb"),
    ("success_criteria", "jsonb"), ("kill_criteria", "jsonb"), ("budget_tokens", "integer"),
    ("budget_seconds", "integer"), ("budget_usd", "numeric"), ("status", "text"),
    ("priority", "integer"), ("created_at", "timestamp with time zone"),
    ("started_at", "timestamp with time zone"), ("completed_at", "timestamp with time zone"),
    ("result", "jsonb"), ("error", "text"),
]


def _tables(url: str) -> set[str]:
    with psycopg.connect(urls.libpq_url(url)) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
        ).fetchall()
    return {r[0] for r in rows}


def test_upgrade_downgrade_upgrade_on_an_empty_database(empty_db_url: str) -> None:
    assert migrations.current_revision(empty_db_url) is None
    migrations.upgrade(empty_db_url)
    assert {"tasks", "task_events", "fires", "model_calls"} <= _tables(empty_db_url)
    migrations.downgrade(empty_db_url, "base")
    assert _tables(empty_db_url) <= {"alembic_version"}
    migrations.upgrade(empty_db_url)
    assert migrations.current_revision(empty_db_url) == migrations.HEAD_REVISION


def test_upgrade_twice_is_a_no_op(db_url: str) -> None:
    migrations.upgrade(db_url)
    assert migrations.current_revision(db_url) == migrations.HEAD_REVISION


def test_tasks_has_the_seed_columns_with_their_types_and_defaults(db_url: str) -> None:
    with psycopg.connect(urls.libpq_url(db_url)) as conn:
        cols = conn.execute(
            "SELECT column_name, data_type, column_default, is_nullable "
            "FROM information_schema.columns WHERE table_name = 'tasks' ORDER BY ordinal_position"
        ).fetchall()
        indexes: dict[str, str] = dict(conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'tasks'"
        ).fetchall())
    assert [(c[0], c[1]) for c in cols[:20]] == SEED_COLUMNS
    defaults = {c[0]: c[2] for c in cols}
    assert defaults["id"] == "gen_random_uuid()"
    assert defaults["budget_tokens"] == "50000"
    assert defaults["budget_seconds"] == "300"
    assert defaults["budget_usd"].startswith("1.0")
    assert defaults["status"].startswith("'pending'")
    assert defaults["priority"] == "5"
    assert defaults["created_at"] == "now()"
    nullable = {c[0]: c[3] for c in cols}
    assert nullable["to_agent"] == nullable["type"] == nullable["payload"] == "NO"
    assert "idx_tasks_status_agent" not in indexes  # migration 0020
    assert "WHERE (status = 'escalated'::text)" in indexes["ix_tasks_escalated"]
    assert "(root_id)" in indexes["idx_tasks_root"]
    assert "WHERE" in indexes["ix_tasks_claimable"]


def test_status_check_constraint_refuses_an_unknown_status(db_url: str) -> None:
    with psycopg.connect(urls.libpq_url(db_url)) as conn:
        try:
            conn.execute(
                "INSERT INTO tasks (to_agent, type, payload, status) VALUES ('a','t','{}','bogus')"
            )
        except psycopg.errors.CheckViolation as exc:
            assert "ck_tasks_status_valid" in str(exc)
        else:
            raise AssertionError("a bogus status was accepted")


def test_models_and_migrations_agree(db_url: str) -> None:
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []


def test_head_revision_constant_matches_alembic() -> None:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrations.alembic_config("postgresql://unused/x"))
    assert script.get_current_head() == migrations.HEAD_REVISION


def test_ensure_schema_migrates_an_empty_database_once(empty_db_url: str) -> None:
    migrations.ensure_schema(empty_db_url)
    assert migrations.current_revision(empty_db_url) == migrations.HEAD_REVISION
    migrations.ensure_schema(empty_db_url)  # already current: no Alembic run


def test_a_store_opened_on_an_empty_database_migrates_it_through_its_own_pool(
        empty_db_url: str) -> None:
    from runtime.config import load_settings
    from runtime.wiring import open_store

    settings = load_settings(env={"ORGCHART_DATABASE_URL": empty_db_url})
    store = open_store(settings)
    try:
        assert migrations.current_revision(empty_db_url) == migrations.HEAD_REVISION
        # The connection that asked for the revision went back to the store's pool.
        assert store.engine.pool.checkedin() == 1  # type: ignore[attr-defined]
        with store.engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM tasks")).scalar() == 0
    finally:
        store.dispose()
    again = open_store(settings)  # already at head: one query, no Alembic run
    again.dispose()
