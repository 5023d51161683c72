"""A database that fails over, as the client sees it, and the outage logged once.

A PostgreSQL that fails over (pg_auto_failover, Patroni, a managed service) shows up in
the client as a broken connection (no SQLSTATE, or class 08), 57P01/57P02/57P03 (the
server shutting down or starting), or 25006 (a pooled connection still on the old
primary, now a read-only standby). :func:`is_failover_error` says which errors those
are; :func:`install` hooks an engine so that such an error is a disconnect (SQLAlchemy
discards the connection and its pool's siblings) and :data:`OUTAGE` logs the outage once
and its end once. A COMMIT that failed that way is flagged in doubt
(:func:`mark_in_doubt`, :func:`in_doubt`): it may have committed, and the caller asks the
database before acting again.

Failure modes: a server that cannot be reached or started raises
:class:`DatabaseUnavailable`, with the URL (password hidden).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine

from runtime.core.dberrors import driver_error, one_line

log = logging.getLogger(__name__)


class DatabaseUnavailable(RuntimeError):
    """The database server cannot be reached or started."""


#: SQLSTATEs that mean "this server cannot take our writes now; connect again".
FAILOVER_SQLSTATES = frozenset({"25006", "57P01", "57P02", "57P03"})


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error, or None (a broken connection has none)."""
    state = getattr(driver_error(exc), "sqlstate", None)
    return str(state) if state else None


def is_failover_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the connection or the server is gone (reconnect and retry).

    True for a broken or refused connection (``psycopg.OperationalError`` without a
    SQLSTATE, or SQLAlchemy's invalidated connection), class ``08``, and
    :data:`FAILOVER_SQLSTATES`. False for every other error (a constraint, a bad value,
    a statement timeout: those are the statement's fault, not the server's).
    """
    if isinstance(exc, DatabaseUnavailable) and exc.__cause__ is not None:
        return is_failover_error(exc.__cause__)  # ``cannot reach ...`` wrapping the error
    if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
        return True
    state = sqlstate(exc)
    if state is not None:
        return state in FAILOVER_SQLSTATES or state.startswith("08")
    driver = driver_error(exc)
    return isinstance(driver, psycopg.OperationalError | psycopg.InterfaceError)


def mark_in_doubt(exc: BaseException) -> None:
    """Flag ``exc`` as raised by a COMMIT whose outcome is unknown."""
    exc._orgchart_commit_in_doubt = True  # type: ignore[attr-defined]


def in_doubt(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by a COMMIT that may have committed."""
    return bool(getattr(exc, "_orgchart_commit_in_doubt", False))


class Outage:
    """One process's view of the database being away: logged once, and its end once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started: float | None = None
        self.outages = 0
        #: INFO by default: a command that gives up says so in its one error line. A
        #: long-running process (a worker, ``serve``) raises it to WARNING.
        self.level = logging.INFO

    @property
    def active(self) -> bool:
        """Whether an outage is in progress (an error seen, no connection since)."""
        return self.started is not None

    def begin(self, exc: BaseException) -> None:
        """Note a failover error; the first one of an outage is logged."""
        with self._lock:
            if self.started is not None:
                return
            self.started = time.monotonic()
            self.outages += 1
        state = sqlstate(exc)
        what = f"SQLSTATE {state}" if state else "broken"
        log.log(self.level, f"database connection lost ({what}: {one_line(exc, 200)}); "
                "reconnecting to the primary and retrying")

    def end(self, where: str) -> None:
        """Note a new connection; ends an outage (logged with how long it lasted)."""
        with self._lock:
            if self.started is None:
                return
            lasted = time.monotonic() - self.started
            self.started = None
        log.log(self.level, f"database reachable again after {lasted:.1f}s ({where})")


#: The process's outage (every engine of the process shares it).
OUTAGE = Outage()


def install(engine: Engine) -> Engine:
    """Hook ``engine``: failover errors discard the pool; log the outage once."""

    @event.listens_for(engine, "handle_error")
    def _on_error(context: Any) -> None:
        exc = context.original_exception
        if is_failover_error(exc):
            context.is_disconnect = True  # SQLAlchemy invalidates the pool on a disconnect
            OUTAGE.begin(exc)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        if OUTAGE.active:
            info = getattr(dbapi_connection, "info", None)
            where = f"{info.host}:{info.port}" if info is not None else "connected"
            OUTAGE.end(where)

    return engine
