"""A worker incarnation's liveness session: a lock PostgreSQL frees when the process dies.

Each worker incarnation (its ``lease_owner``) keeps one connection of its own open for as
long as it runs. On it, ``worker_session_register`` takes a session-level advisory lock
(:data:`LIVENESS_NAMESPACE`, a key from the owner's name) and writes the owner's
``worker_sessions`` row from that same session, with the server's start time. When the
process dies (SIGKILL, an OOM kill, a crash) while its host and PostgreSQL live, the
kernel closes its socket, PostgreSQL ends the session within milliseconds and frees the
lock; any worker's ``task_reap_dead_owners`` pass (:meth:`store.hygiene.reap_dead
<runtime.store.hygiene.Hygiene.reap_dead>`) then sees an owner registered on this
server run whose lock nobody holds, and takes its tasks back, fenced by their lease
tokens as the reaper is.

Why a lock and not a heartbeat row: the session's end is what PostgreSQL knows first and
for sure, costs nothing while the worker lives (no write per beat), and needs no clock.
What it cannot see, leases still cover: a host cut off from the database keeps its
session open on the server until TCP gives up, and after a restart or a failover every
session is new (the start time differs), so leases decide then.

Failure modes: a key held by another session (a hash collision, or this owner's own
previous session that the server has not ended yet after a network break) is skipped for
the next of :data:`KEYS_TRIED` keys; the row names the key held. A broken connection is
closed and the next :meth:`LivenessSession.ensure` opens a new one, takes the lock and
registers again; until then the owner looks dead and its tasks may be taken back (its
late writes are refused by their lease tokens). The session needs a real server session:
a transaction-pooling proxy (PgBouncer in transaction mode) would break it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from runtime.store.queries import TEXT as _TEXT

log = logging.getLogger(__name__)

#: The first key of every liveness lock (``b"orgc"`` as an int4): the two-key form keeps
#: them apart from the single-key locks the runtime takes elsewhere.
LIVENESS_NAMESPACE = int.from_bytes(b"orgc", "big", signed=True)
#: Keys tried in turn when one is held by another session.
KEYS_TRIED = 16


def lock_key(owner: str, n: int = 0) -> int:
    """The ``n``-th candidate key (a signed int4) of ``owner``'s liveness lock."""
    base = int.from_bytes(hashlib.sha256(owner.encode()).digest()[:4], "big", signed=True)
    return (base + n + 2**31) % 2**32 - 2**31


@dataclass(frozen=True)
class Registration:
    """What one registration wrote: the key held and the backend that holds it."""

    owner: str
    lock_key: int
    backend_pid: int
    server_started_at: Any


class LivenessSession:
    """One owner's liveness lock and registration, on a connection of its own.

    Args:
        engine: where to connect (keep the connection out of a busy pool: one of its own).
        owner: the worker incarnation's name, as written to ``tasks.lease_owner``.

    Attributes:
        registration: the current registration, None while not registered.

    """

    def __init__(self, engine: Engine, owner: str) -> None:
        self._engine = engine
        self.owner = owner
        self.registration: Registration | None = None
        self._conn: Connection | None = None

    @property
    def connection(self) -> Connection:
        """The session's connection, opened when needed (not registered by that alone)."""
        if self._conn is None:
            self._conn = self._engine.connect()
        return self._conn

    def register(self) -> Registration | None:
        """Take the lock (the first free key of :data:`KEYS_TRIED`) and write the row.

        Returns the registration, or None when every key was held by another session.
        A database error propagates (the connection is closed first).
        """
        try:
            for n in range(KEYS_TRIED):
                with self.connection.begin():
                    row = self.connection.execute(
                        _TEXT["worker_session_register"],
                        {"namespace": LIVENESS_NAMESPACE, "key": lock_key(self.owner, n),
                         "owner": self.owner}).first()
                if row is not None:
                    self.registration = Registration(row.owner, row.lock_key,
                                                     row.backend_pid, row.server_started_at)
                    return self.registration
        except sa.exc.DBAPIError:
            self.close()
            raise
        log.warning("no free liveness lock for %s: its tasks wait for their leases if it "
                    "dies", self.owner)
        return None

    def ensure(self) -> Registration | None:
        """Register unless registered on a connection still open (no round trip then)."""
        if self.registration is not None and self._conn is not None \
                and not self._conn.closed and not self._conn.invalidated:
            return self.registration
        self.registration = None
        return self.register()

    def failed(self, exc: BaseException) -> None:
        """A statement on the session failed: close it if the connection broke."""
        broken = isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated
        if broken or (self._conn is not None and self._conn.invalidated):
            self.close()

    def close(self) -> None:
        """Close the connection for real: the session ends and the lock with it.

        The row stays: a pass deletes it once the owner holds no task, and takes back
        what it still holds (nothing, after a clean stop that released its tasks).
        """
        if self._conn is not None:
            with contextlib.suppress(sa.exc.DBAPIError):
                self._conn.invalidate()  # never back to the pool with the lock held
                self._conn.close()
        self._conn = None
        self.registration = None
