"""Streamed text's write side: pieces per second, rows per call, WAL per KB of text.

    python -m bench.stream_writes [--calls 200] [--chars 2000] [--tokens-per-second 50]

``calls`` model calls stream at once, each ``chars`` characters in tokens of 4
characters at ``tokens_per_second`` (a local model's pace), into one
:class:`~runtime.engine.text_writer.TextWriter` at the default ``[streaming]`` settings,
on a scratch database (each call's task claimed, so every write is fenced as in a
worker); ``--flush-seconds`` / ``--flush-chars`` try other windows. Figures:

- ``stream_rows_per_call`` and ``stream_chars_per_row``: how the flush window groups tokens;
- ``stream_rows_per_second`` and ``stream_batches_per_second``: what the writer committed;
- ``stream_wal_bytes_per_kb_text``: WAL written (``pg_current_wal_lsn``) per KB of text
  (issue 47's goal: <= 3 KB);
- ``stream_finish_ms_p50`` / ``_p99``: from a call's last token to its last piece
  committed (what a call waits for at its end).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import sqlalchemy as sa

from bench.common import open_store, report, scratch_database
from runtime.engine.text_writer import TextWriter
from runtime.llm.text_stream import CallAttempts
from runtime.store.rows import NewTask


def _claimed(store: Any, n: int) -> list[dict[str, Any]]:
    for _ in range(n):
        store.tasks.submit(NewTask(to_agent="scout", type="task", payload={"goal": "g"}))
    return list(store.claims.claim(["scout"], n, "bench", 300))


def _wal(store: Any) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')")).scalar_one())


def measure(calls: int, chars: int, tokens_per_second: float,
            server: str | None = None, flush_seconds: float = 0.1,
            flush_chars: int = 256) -> dict[str, Any]:
    """Stream ``calls`` calls at once through one writer; return the figures."""
    with scratch_database("stream_writes", server) as url:
        store = open_store(url, pool_size=4)
        rows = _claimed(store, calls)
        writer = TextWriter(store, flush_seconds, flush_chars)
        finish_ms: list[float] = []
        lock = threading.Lock()
        token = "abc "  # one token: 4 characters
        tokens = chars // len(token)
        gap = 1.0 / tokens_per_second

        def one(row: dict[str, Any], n: int) -> None:
            stream = writer.open(row["id"], row["lease_token"], "run", 0, CallAttempts())
            time.sleep(gap * n / calls)  # spread the starts over one token's gap
            next_at = time.monotonic()
            for _ in range(tokens):
                stream.add(token)
                next_at += gap
                time.sleep(max(0.0, next_at - time.monotonic()))
            ended = time.monotonic()
            done = threading.Event()
            stream.end()
            if not stream.wait(lambda _ok: done.set()):
                done.wait(30)
            with lock:
                finish_ms.append((time.monotonic() - ended) * 1000)

        wal_before = _wal(store)
        started = time.monotonic()
        threads = [threading.Thread(target=one, args=(row, n)) for n, row in enumerate(rows)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.monotonic() - started
        wal = _wal(store) - wal_before
        with store.engine.connect() as conn:
            stored = conn.execute(sa.text(
                "SELECT count(*), coalesce(sum(char_length(text)), 0) FROM call_text")).one()
        writer.close()
        store.engine.dispose()
    quantiles = statistics.quantiles(finish_ms, n=100)
    return {
        "stream_calls": calls, "stream_chars_per_call": tokens * len(token),
        "stream_tokens_per_second_per_call": tokens_per_second,
        "stream_flush_seconds": flush_seconds, "stream_flush_chars": flush_chars,
        "stream_seconds": round(seconds, 2),
        "stream_rows": int(stored[0]), "stream_chars": int(stored[1]),
        "stream_rows_per_call": round(int(stored[0]) / calls, 1),
        "stream_chars_per_row": round(int(stored[1]) / max(1, int(stored[0])), 1),
        "stream_rows_per_second": round(int(stored[0]) / seconds),
        "stream_batches_per_second": round(writer.batches / seconds, 1),
        "stream_wal_bytes_per_kb_text": round(wal / (int(stored[1]) / 1024)),
        "stream_finish_ms_p50": round(statistics.median(finish_ms), 1),
        "stream_finish_ms_p99": round(quantiles[98], 1),
    }


def main(calls: int = 200, chars: int = 2000, tokens_per_second: float = 50.0,
         server: str | None = None, flush_seconds: float = 0.1,
         flush_chars: int = 256) -> dict[str, Any]:
    """Measure and print the figures."""
    return report("stream_writes", measure(calls, chars, tokens_per_second, server,
                                           flush_seconds, flush_chars))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--chars", type=int, default=2000)
    parser.add_argument("--tokens-per-second", type=float, default=50.0)
    parser.add_argument("--server", default=None)
    parser.add_argument("--flush-seconds", type=float, default=0.1)
    parser.add_argument("--flush-chars", type=int, default=256)
    args = parser.parse_args()
    main(args.calls, args.chars, args.tokens_per_second, args.server, args.flush_seconds,
         args.flush_chars)
