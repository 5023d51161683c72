"""The SQLAlchemy engines the store uses: a pool, or one connection at a time.

Every engine made here sets TCP keepalives and ``tcp_user_timeout`` (from the URL's
:class:`~runtime.store.postgres.urls.ConnectionOptions`) and is hooked by
:func:`~runtime.store.postgres.failover.install`, so a failover error discards the pool
and the outage is logged once.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from runtime.jsoncodec import loads_fast
from runtime.store.postgres.failover import install
from runtime.store.postgres.urls import ConnectionOptions, with_options

#: The keepalives and timeouts an engine gets unless told otherwise (frozen: shareable).
DEFAULT_OPTIONS = ConnectionOptions()


def create_db_engine(url: str, pool_size: int = 10, statement_timeout_ms: int = 0,
                     options: ConnectionOptions | None = DEFAULT_OPTIONS) -> Engine:
    """Create the engine used by the store (psycopg 3, pre-ping for restarts).

    Workers keep the pre-ping too: without it the first statement after a server restart
    fails on a dead pooled connection. The ping is one round trip per transaction, that
    is per batch of claims, outcomes or charges, not per task.

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
    return install(sa.create_engine(
        full, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True,
        pool_recycle=1800, connect_args=connect_args, json_deserializer=loads_fast))


def one_shot_engine(url: str) -> Engine:
    """An engine without a pool (migrations, one query), with the default options."""
    return install(sa.create_engine(with_options(url, DEFAULT_OPTIONS),
                                    poolclass=sa.pool.NullPool, json_deserializer=loads_fast))
