"""Durable steps' two writes from a coroutine: async psycopg, no thread hop, no ping.

A tool round of a model's tool loop records its step twice (``task_step_begin`` before
the tool runs, ``task_step_finish`` after). Through the Store each write cost a thread
hop, a pool checkout (a ping when the connection was idle) and SQLAlchemy's statement
handling: about 1.3 ms, against 0.2 ms for the statement itself. :class:`AsyncStepWriter`
runs the same two statements (``runtime/store/queries.sql``) on psycopg
``AsyncConnection`` s of the caller's event loop, prepared by the server after a few
uses.

- **Connections.** Each event loop gets its own small set (at most
  :data:`CONNECTIONS_PER_LOOP` at once; more steps in flight wait for one). A connection
  idle for more than :data:`~runtime.store.postgres.engines.PING_IDLE_SECONDS` is
  pinged before use (as the Store's pool does), and a broken one is replaced.
- **Failures.** A statement that fails on a connection error (the server restarted, a
  failover) is run once more on a new connection. Both statements are safe to repeat:
  a repeated begin counts one more start (it may have run: the conservative side), and a
  repeated finish that finds its step already recorded by the lost attempt says so
  (``task_step_finish`` returns the row) without charging twice.
- **Fencing and durability** are the statements' own (see ``queries.sql``): both read
  the task row ``FOR SHARE`` with the lease token; the begin commits without waiting for
  the disk, the finish waits for it (a recorded result is what keeps a side effect from
  running again after a crash, so it must survive one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row

from runtime.records import StepBegin, StepEnd, StepRecord
from runtime.store.postgres.engines import PING_IDLE_SECONDS
from runtime.store.postgres.urls import libpq_url
from runtime.store.queries import QUERIES
from runtime.store.steps import step_begin_params, step_end_params, step_record

log = logging.getLogger(__name__)

#: Connections one event loop holds at most for step writes.
CONNECTIONS_PER_LOOP = 4


def psycopg_sql(sql: str) -> str:
    """``queries.sql``'s ``:name`` parameters in psycopg's ``%(name)s`` form (no comments)."""
    code = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    return re.sub(r"(?<![:\w]):([a-z_][a-z0-9_]*)\b", r"%(\1)s", code.replace("%", "%%"))


_BEGIN = psycopg_sql(QUERIES["task_step_begin"])
_FINISH = psycopg_sql(QUERIES["task_step_finish"])


class _LoopConnections:
    """The connections of one event loop: free ones, and a bound on those in use."""

    def __init__(self) -> None:
        self.free: list[tuple[psycopg.AsyncConnection[Any], float]] = []
        self.slots = asyncio.Semaphore(CONNECTIONS_PER_LOOP)


class AsyncStepWriter:
    """Begins and finishes durable steps on the running loop's own connections.

    Args:
        url: the database URL (the Store's engine URL, options included).

    """

    def __init__(self, url: str) -> None:
        self._url = libpq_url(url)
        self._loops: dict[asyncio.AbstractEventLoop, _LoopConnections] = {}

    async def begin(self, begin: StepBegin) -> StepRecord | None:
        """``task_step_begin``: the step's row (started now, or finished: a replay)."""
        row = await self._run(_BEGIN, step_begin_params(begin))
        if row is None:
            log.warning("late step ignored: lease gone", extra={"task_id": str(begin.task_id),
                                                                "step": begin.name})
            return None
        return step_record(row)

    async def finish(self, end: StepEnd) -> bool:
        """``task_step_finish``: record the result or error; False when the lease is gone."""
        row = await self._run(_FINISH, step_end_params(end))
        if row is None:
            log.warning("late step result ignored: lease gone",
                        extra={"task_id": str(end.task_id), "step_id": end.step_id})
            return False
        return True

    async def fetch_all(self, sql: str, params: dict[str, Any]) -> list[Any]:
        """Any other statement's rows on the loop's connections (a record look-up's read).

        ``sql`` in psycopg's form (:func:`psycopg_sql`); run once more on a new connection
        after a broken one, as the step writes are (a read is safe to repeat).
        """
        for attempt in (1, 2):
            async with self._connection(fresh=attempt == 2) as conn:
                try:
                    cursor = await conn.execute(sql, params)  # type: ignore[arg-type]
                    return await cursor.fetchall()
                except psycopg.OperationalError:
                    if attempt == 2 or not conn.broken:
                        raise
        raise AssertionError("unreachable")  # pragma: no cover

    def idle_backend_pids(self) -> list[int]:
        """The server process ids of the idle connections of every loop (a diagnostic)."""
        return [conn.info.backend_pid for pool in list(self._loops.values())
                for conn, _ in list(pool.free)]

    async def aclose(self) -> None:
        """Close the running loop's connections (before the loop ends)."""
        pool = self._loops.pop(asyncio.get_running_loop(), None)
        for conn, _ in pool.free if pool is not None else ():
            await _close(conn, "the loop is ending")

    # ------------------------------------------------------------------ parts
    async def _run(self, sql: str, params: dict[str, Any]) -> Any:
        """One statement and its first row; once more on a new connection after a broken one."""
        for attempt in (1, 2):
            async with self._connection(fresh=attempt == 2) as conn:
                try:
                    cursor = await conn.execute(sql, params)  # type: ignore[arg-type]
                    return await cursor.fetchone()
                except psycopg.OperationalError:
                    if attempt == 2 or not conn.broken:
                        raise
                    log.warning("step write: connection lost; once more on a new one")
        raise AssertionError("unreachable")  # pragma: no cover

    @contextlib.asynccontextmanager
    async def _connection(self, fresh: bool) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        loop = asyncio.get_running_loop()
        pool = self._loops.get(loop)
        if pool is None:
            pool = self._loops[loop] = _LoopConnections()
        async with pool.slots:
            conn = None if fresh else await self._reuse(pool)
            if conn is None:
                conn = await psycopg.AsyncConnection.connect(
                    self._url, autocommit=True, row_factory=namedtuple_row)
            try:
                yield conn
            finally:
                if conn.broken or conn.closed:
                    await _close(conn, "it broke")
                else:
                    pool.free.append((conn, time.monotonic()))

    @staticmethod
    async def _reuse(pool: _LoopConnections) -> psycopg.AsyncConnection[Any] | None:
        while pool.free:
            conn, since = pool.free.pop()
            if conn.closed or conn.broken:
                continue
            if time.monotonic() - since < PING_IDLE_SECONDS:
                return conn
            try:
                await conn.execute("SELECT 1")
                return conn
            except psycopg.Error:
                await _close(conn, "it failed its ping after an idle spell")
        return None


async def _close(conn: psycopg.AsyncConnection[Any], why: str) -> None:
    """Close a connection given up on; a failure to close it is logged, not raised.

    The connection is dropped either way (a broken one's socket is gone already), so the
    failure changes nothing but is worth a line when connections leak.
    """
    try:
        await conn.close()
    except (psycopg.Error, OSError):
        log.debug("a step connection could not be closed (dropped because %s)", why,
                  exc_info=True)
