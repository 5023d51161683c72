"""One pgqueuer worker process for ``bench.pgqueuer_drain``: drains its no-op jobs and exits.

Kept apart from ``bench.pgqueuer_drain`` so that the process imports only what pgqueuer
needs (asyncpg, pgqueuer): importing ``bench.common`` brought SQLAlchemy, psycopg and
our store in too, about 0.5 s of start-up on the two-core bench machine that a pgqueuer
deployment does not pay, and its clock counts start-up.

    python -m bench.pgqueuer_worker DSN [--consumers 5] [--batch-size 100]

``DSN`` is a libpq connection string (``postgresql://...``), as asyncpg takes it.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import asyncpg
from pgqueuer import AsyncpgDriver, PgQueuer
from pgqueuer.types import QueueExecutionMode


async def consumer(dsn: str, batch_size: int) -> None:
    """One pgqueuer consumer on its own asyncpg connection: a no-op entrypoint, drain mode."""
    conn = await asyncpg.connect(dsn=dsn)
    pgq = PgQueuer(AsyncpgDriver(conn))

    @pgq.entrypoint("noop")
    async def noop(job: Any) -> None:
        return None

    await pgq.run(batch_size=batch_size, mode=QueueExecutionMode.drain)
    await conn.close()


async def worker(dsn: str, consumers: int, batch_size: int) -> None:
    """One process: ``consumers`` pgqueuer consumers on one event loop (as its own bench)."""
    await asyncio.gather(*(consumer(dsn, batch_size) for _ in range(consumers)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dsn")
    parser.add_argument("--consumers", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(worker(args.dsn, args.consumers, args.batch_size))
