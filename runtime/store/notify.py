"""The task channel: one connection subscribed to LISTEN/NOTIFY, for a worker's listener.

New or released work is announced on :data:`~runtime.store.queries.TASKS_CHANNEL` (the
payload is the agent name, ``judge`` for the judge stage). :class:`TaskChannel` opens its
own autocommit connection (a pooled one would hand the subscription to whoever borrows it
next) and subscribes with the named statement ``channel_listen_tasks``.

The URL may name several hosts (a failover formation): the connection goes to the one
that takes writes (``target_session_attrs=read-write``), and the channel checks
``pg_is_in_recovery()`` before it subscribes, so it never listens on a standby (a
multi-host URL without ``target_session_attrs``, or a primary demoted since): it raises
:class:`StandbyServer` instead and the caller tries again. Keepalives and
``tcp_user_timeout`` come with the URL (:func:`runtime.store.postgres.urls.with_options`), so a
listener whose server vanished notices in seconds, not after the kernel's 15 minutes.

Failure modes: a dropped connection raises from :meth:`TaskChannel.notes`
(``psycopg.Error``); the caller closes the channel and opens a new one, which subscribes
again (a LISTEN does not survive its connection).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType

import psycopg
from sqlalchemy.engine import Engine

from runtime.store.postgres.urls import libpq_url
from runtime.store.queries import QUERIES

#: Seconds to wait for the server when the channel connects.
CONNECT_TIMEOUT_SECONDS = 5


class StandbyServer(psycopg.OperationalError):
    """The channel reached a standby (``pg_is_in_recovery()``): look for the primary again."""


class TaskChannel:
    """A connection subscribed to the task channel; close it when done.

    Args:
        url: the database URL (SQLAlchemy or libpq form).
        connect_timeout: seconds to wait for the server.
        listen: the named ``LISTEN`` statement (``channel_listen_webhooks`` for the
            webhook deliverers' channel).

    """

    def __init__(self, url: str, connect_timeout: int = CONNECT_TIMEOUT_SECONDS,
                 listen: str = "channel_listen_tasks") -> None:
        self._conn = psycopg.connect(libpq_url(url), autocommit=True,
                                     connect_timeout=connect_timeout)
        try:
            row = self._conn.execute(QUERIES["server_in_recovery"]).fetchone()
            if row is not None and row[0]:
                info = self._conn.info
                raise StandbyServer(f"{info.host}:{info.port} is a standby (in recovery); "
                                    "the listener will look for the primary again")
            self._conn.execute(QUERIES[listen])
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def open(cls, engine: Engine) -> TaskChannel:
        """A channel on the database ``engine`` connects to (a Store's ``engine``)."""
        return cls(engine.url.render_as_string(hide_password=False))

    def notes(self, timeout: float) -> Iterator[str]:
        """Yield each payload as it arrives, for up to ``timeout`` seconds."""
        for note in self._conn.notifies(timeout=timeout):
            yield note.payload

    def close(self) -> None:
        """Close the connection (the subscription ends with it)."""
        self._conn.close()

    def __enter__(self) -> TaskChannel:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
