"""What every part of the store shares: the engine, one transaction helper, named statements.

Each part of the store (:mod:`runtime.store.webhooks`, :mod:`runtime.store.schedules`,
...) takes a :class:`Database` in its constructor and runs its statements through it;
no part inherits another, and a part that needs another's method is handed that part.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from runtime.store.postgres import failover
from runtime.store.queries import TEXT as _TEXT
from runtime.store.queries import Task


class Database:
    """The engine, the one transaction helper, and the runner of ``queries.sql``'s statements."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """Yield a connection inside one transaction (committed on success).

        An error raised by the COMMIT itself when the connection broke is flagged
        in doubt (:func:`runtime.store.postgres.failover.in_doubt`): the transaction may have
        committed, and the caller must find out from the database before it acts again.
        """
        with self.engine.connect() as conn:
            trans = conn.begin()
            try:
                yield conn
            except BaseException:
                if trans.is_active:
                    with suppress(sa.exc.DBAPIError):  # the connection may be gone already
                        trans.rollback()
                raise
            try:
                trans.commit()
            except sa.exc.DBAPIError as exc:
                if failover.is_failover_error(exc):
                    failover.mark_in_doubt(exc)
                raise

    def connect(self) -> Connection:
        """A pooled connection, outside any explicit transaction (close it: ``with``)."""
        return self.engine.connect()

    @staticmethod
    def rows(conn: Connection, statement: str, /, **params: Any) -> list[Task]:
        """Run the named statement on ``conn``; its rows as dicts.

        ``statement`` is positional only, so that ``name`` may be one of the parameters.
        """
        return [dict(row._mapping) for row in conn.execute(_TEXT[statement], params)]

    def query(self, statement: str, /, **params: Any) -> list[Task]:
        """Run one named read-only statement on a connection of its own; its rows as dicts."""
        with self.engine.connect() as conn:
            return self.rows(conn, statement, **params)
