"""When the database goes away: which errors mean "reconnect", and how to log an outage.

A PostgreSQL that fails over (pg_auto_failover, Patroni, a managed service) shows up in
the client as one of a few errors:

- the connection breaks (no SQLSTATE: the server was killed, the host vanished, a
  keepalive or ``tcp_user_timeout`` gave up), or class ``08`` (connection exceptions);
- ``57P01`` admin shutdown, ``57P02`` crash shutdown, ``57P03`` cannot connect now (the
  server is starting or shutting down);
- ``25006`` read-only transaction: a pooled connection still points at the old primary,
  now a standby.

:func:`is_failover_error` says whether an error is one of those. :func:`install` hooks an
engine so that such an error marks its connection as a disconnect: SQLAlchemy then
discards it and every other connection its pool holds (the next checkout connects again,
and a multi-host URL with ``target_session_attrs=read-write`` finds the new primary).
:class:`Outage` logs the first error of an outage once per process, and the recovery
once, so a failover is two log lines, not a stack of tracebacks.

A COMMIT whose connection broke may or may not have committed. :func:`mark_in_doubt`
flags the error so the caller can find out from the database what happened before it
acts again (see :meth:`runtime.store.reads.StoreReads.transaction`); :func:`in_doubt`
reads the flag.

:func:`retry` runs a call again while the database fails over, with backoff, up to a
deadline: for a command-line call that should ride out a failover (``submit``) rather
than fail at once.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)

#: SQLSTATEs that mean "this server cannot take our writes now; connect again".
FAILOVER_SQLSTATES = frozenset({"25006", "57P01", "57P02", "57P03"})
T = TypeVar("T")
_IN_DOUBT = "_orgchart_commit_in_doubt"


def _driver_error(exc: BaseException) -> BaseException:
    """The driver's exception under SQLAlchemy's wrapper (or ``exc`` itself)."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error, or None (a broken connection has none)."""
    state = getattr(_driver_error(exc), "sqlstate", None)
    return str(state) if state else None


def is_failover_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the connection or the server is gone (reconnect and retry).

    True for a broken or refused connection (``psycopg.OperationalError`` without a
    SQLSTATE, or SQLAlchemy's invalidated connection), class ``08``, and
    :data:`FAILOVER_SQLSTATES`. False for every other error (a constraint, a bad value,
    a statement timeout: those are the statement's fault, not the server's).
    """
    if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
        return True
    state = sqlstate(exc)
    if state is not None:
        return state in FAILOVER_SQLSTATES or state.startswith("08")
    driver = _driver_error(exc)
    return isinstance(driver, psycopg.OperationalError | psycopg.InterfaceError)


def mark_in_doubt(exc: BaseException) -> None:
    """Flag ``exc`` as raised by a COMMIT whose outcome is unknown."""
    setattr(exc, _IN_DOUBT, True)


def in_doubt(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by a COMMIT that may have committed."""
    return bool(getattr(exc, _IN_DOUBT, False))


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
        message = str(_driver_error(exc)).strip().splitlines()
        first = message[0][:200] if message else type(exc).__name__
        what = f"SQLSTATE {state}" if state else "broken"
        log.log(self.level, f"database connection lost ({what}: {first}); "
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


def backoff_delays(first: float = 0.1, cap: float = 2.0) -> Callable[[], float]:
    """A generator of delays: doubling from ``first`` up to ``cap``, with jitter."""
    state = {"next": first}

    def delay() -> float:
        value = state["next"]
        state["next"] = min(cap, value * 2)
        return value * (0.5 + random.random() / 2)

    return delay


def retry(fn: Callable[[], T], timeout: float, on_retry: Callable[[BaseException], None]
          | None = None) -> T:
    """Call ``fn``; on a failover error, back off and call it again, up to ``timeout`` s.

    ``fn`` must be safe to call again after an in-doubt COMMIT (guarded, or keyed by an
    idempotency key). The last error is raised when the time is up; any other error at
    once.
    """
    deadline = time.monotonic() + timeout
    delay = backoff_delays()
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_failover_error(exc) or time.monotonic() >= deadline:
                raise
            OUTAGE.begin(exc)
            if on_retry is not None:
                on_retry(exc)
            time.sleep(max(0.0, min(delay(), deadline - time.monotonic())))
