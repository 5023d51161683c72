"""Database URLs: which one, in libpq's and SQLAlchemy's forms, with our options.

``ORGCHART_DATABASE_URL`` (or ``DATABASE_URL``, or ``[database] url``) names a server;
without one, :func:`settled_url` starts the embedded one. The URL may name several hosts
in libpq's form (``postgresql://u@h1:p1,h2:p2/db?target_session_attrs=read-write``, what
``pg_autoctl show uri`` prints): :func:`sqlalchemy_url` turns it into SQLAlchemy's form
(``?host=h1:p1&host=h2:p2``) and :func:`libpq_url` back, so every connection (pools, the
LISTEN connection, migrations) tries the hosts in turn and keeps the writable one.
:func:`with_options` adds TCP keepalives and ``tcp_user_timeout``
(:class:`ConnectionOptions`, from ``[database]``) so that a vanished peer is noticed in
seconds. :func:`redacted` hides the password for messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlencode, urlsplit

from sqlalchemy.engine import URL, make_url

from runtime.store.postgres.embedded import embedded_server, orgchart_home


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
