"""The SQLAlchemy engines the store uses: a pool, or one connection at a time.

Every engine made here sets TCP keepalives and ``tcp_user_timeout`` (from the URL's
:class:`~runtime.store.postgres.urls.ConnectionOptions`) and is hooked by
:func:`~runtime.store.postgres.failover.install`, so a failover error discards the pool
and the outage is logged once.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.pool import ConnectionPoolEntry

from runtime.jsoncodec import loads_fast
from runtime.store.postgres.failover import install, is_failover_error
from runtime.store.postgres.urls import ConnectionOptions, with_options

#: The keepalives and timeouts an engine gets unless told otherwise (frozen: shareable).
DEFAULT_OPTIONS = ConnectionOptions()
#: A pooled connection idle this long is pinged before use (:func:`ping_when_idle`).
PING_IDLE_SECONDS = 1.0


def create_db_engine(url: str, pool_size: int = 10, statement_timeout_ms: int = 0,
                     options: ConnectionOptions | None = DEFAULT_OPTIONS) -> Engine:
    """Create the engine used by the store (psycopg 3, a ping for idle connections).

    A connection back from the pool is pinged only when it sat idle there for
    :data:`PING_IDLE_SECONDS` or more (:func:`ping_when_idle`): that is the connection a
    server restart or failover may have killed while nobody used it, and the first
    statement after a restart must not fail on it. A connection in steady use skips the
    round trip SQLAlchemy's ``pool_pre_ping`` would spend on every transaction (a level
    of a chain runs four or five); if its server died since, the statement fails as a
    failover error (:func:`~runtime.store.postgres.failover.install`), the pool is
    discarded, and the callers that write retry it.

    Args:
        url: the database URL.
        pool_size: connections kept open (as many again may overflow).
        statement_timeout_ms: ``[database] statement_timeout_ms``: the server cancels any
            statement running longer (libpq ``options=-c statement_timeout=N``); 0 sets
            nothing, so the server's own setting (none by default) applies.
        options: keepalives and timeouts added to the URL (so connections derived from
            ``engine.url`` get them too), unless the URL sets them; None adds nothing.

    """
    if statement_timeout_ms < 0:
        raise ValueError(f"statement_timeout_ms cannot be negative (got {statement_timeout_ms})")
    connect_args: dict[str, Any] = {}
    full = with_options(url, options)
    if statement_timeout_ms:  # beside the URL's own ``options`` (connect_args win)
        before = make_url(full).query.get("options")
        timeout = f"-c statement_timeout={int(statement_timeout_ms)}"
        connect_args["options"] = f"{before} {timeout}" if before else timeout
    # jsonb is read by orjson where it reads what json would (runtime.jsoncodec).
    engine = sa.create_engine(
        full, pool_size=pool_size, max_overflow=pool_size, pool_recycle=1800,
        connect_args=connect_args, json_deserializer=loads_fast)
    return install(ping_when_idle(engine))


def ping_when_idle(engine: Engine, idle_seconds: float = PING_IDLE_SECONDS) -> Engine:
    """Ping a pooled connection at checkout when it was idle ``idle_seconds`` or more.

    A connection the ping finds dead is replaced (the pool's pessimistic check: a
    ``DisconnectionError`` from a checkout listener discards it and connects again). A new
    connection and one checked in less than ``idle_seconds`` ago are not pinged.
    """
    @event.listens_for(engine, "checkin")
    def _checked_in(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        record.info["checked_in_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: ConnectionPoolEntry,
                     proxy: Any) -> None:
        since = record.info.get("checked_in_at")
        if since is None or time.monotonic() - since < idle_seconds:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except psycopg.Error as exc:
            if is_failover_error(exc):
                raise sa.exc.DisconnectionError(f"an idle pooled connection is gone: {exc}") \
                    from exc
            raise

    return engine


def one_shot_engine(url: str) -> Engine:
    """An engine without a pool (migrations, one query), with the default options."""
    return install(sa.create_engine(with_options(url, DEFAULT_OPTIONS),
                                    poolclass=sa.pool.NullPool, json_deserializer=loads_fast))
