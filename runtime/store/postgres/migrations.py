"""The schema: Alembic's migrations run up to head, once, by one process at a time.

Failure modes: a server that does not answer raises
:class:`~runtime.store.postgres.failover.DatabaseUnavailable` with the URL (password
hidden).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from runtime.store.postgres.engines import one_shot_engine
from runtime.store.postgres.failover import DatabaseUnavailable
from runtime.store.postgres.urls import redacted, sqlalchemy_url
from runtime.store.queries import TEXT

MIGRATIONS_DIR = Path(__file__).resolve().parents[3] / "migrations"
#: The newest migration; a test keeps it equal to Alembic's head. Lets every process skip
#: loading Alembic when the database is already current.
HEAD_REVISION = "0020"


def alembic_config(url: str) -> Any:
    """Return an Alembic ``Config`` for ``url`` that works from a checkout or an install."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Run the migrations up to ``revision`` (idempotent; serialised by an advisory lock)."""
    from alembic import command

    engine = one_shot_engine(url)
    try:
        with engine.connect() as conn:
            # Several processes may start at once on a fresh database; one migrates.
            conn.execute(TEXT["migration_lock_acquire"])
            conn.commit()
            try:
                cfg = alembic_config(url)
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
                conn.commit()
            except BaseException:
                conn.rollback()
                raise
            finally:
                conn.execute(TEXT["migration_lock_release"])
                conn.commit()
    except sa.exc.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot reach {redacted(url)}: {exc.orig}") from exc
    finally:
        engine.dispose()


def ensure_schema(url: str, engine: Engine | None = None) -> None:
    """Migrate to head unless the database is already there (one cheap query).

    ``engine``: ask through it (a worker's pool: the connection then serves the work too).
    """
    try:
        if current_revision(url, engine) == HEAD_REVISION:
            return
    except sa.exc.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot reach {redacted(url)}: {exc.orig}") from exc
    upgrade(url)


def downgrade(url: str, revision: str = "base") -> None:
    """Run the migrations down to ``revision``."""
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def current_revision(url: str, engine: Engine | None = None) -> str | None:
    """The database's Alembic revision, None for an empty one (through ``engine`` if given)."""
    with (engine or one_shot_engine(url)).connect() as conn:  # NullPool: closed on exit
        if conn.execute(TEXT["migration_version_table_exists"]).scalar() is None:
            return None
        revision: str | None = conn.execute(TEXT["migration_version_get"]).scalar()
        return revision
