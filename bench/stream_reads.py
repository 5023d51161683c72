"""Streamed text's read side: how soon a connected SSE reader sees a piece.

    python -m bench.stream_reads [--calls 100] [--tokens 40] [--tokens-per-second 20]

One tree on a scratch database: a root and ``calls`` children, each claimed, so every
write is fenced by its lease as in a worker. ``GET /trees/{root}/stream`` is served by
uvicorn on loopback (the stream's routes only) and read by one httpx client over real
HTTP. Figures:

- ``stream_first_text_ms_p50`` / ``_p99`` (issue 47's ``stream_first_text_ms``: goal
  p50 <= 30 ms, p99 <= 150 ms): ``calls`` calls stream at once through the worker's
  :class:`~runtime.engine.text_writer.TextWriter` at the default ``[streaming]``
  settings; from each call's first token handed to the writer to the reader receiving
  the SSE event that carries it (the writer writes a call's first text at once);
  ``stream_first_text_from_write_ms_*``: the same from the start of the transaction
  that wrote it (its ``created_at``), the writer's queue left out, split at the moment
  the snapshot's xmin passed its transaction (a thread probes it every 2 ms): from the
  write's start to readable (the write, its commit, older transactions still open),
  then from readable to the reader (the stream's own part);
- ``stream_piece_ms_p50`` / ``_p99``: the same for every token (its flush window
  included: a piece waits up to ``flush_seconds`` for its batch);
- ``stream_reconnects``, ``_gaps``, ``_duplicates``: a second reader drops its
  connection 100 times while the calls stream and comes back each time with
  ``Last-Event-ID``; what it got against one whole read of the stream afterwards (issue
  47's ``reconnect``: 0 gaps, 0 duplicates);
- ``stream_read_ms_p50`` / ``_p99``: the read side alone: from the COMMIT of a piece
  written in its own transaction (``--pieces`` of them, ``--gap`` seconds apart) to the
  reader receiving it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from decimal import Decimal
from typing import Any

import httpx
import sqlalchemy as sa
from fastapi import FastAPI

from bench.common import open_store, report, scratch_database
from runtime.engine.text_writer import TextWriter
from runtime.http.stream import add_stream_routes
from runtime.llm.text_stream import CallAttempts
from runtime.store.rows import ChildRow, NewTask
from runtime.store.store import Store
from runtime.store.streams import follow
from tests.asgi_server import Server


def _stream_server(store: Store) -> Server:
    """uvicorn serving the stream's routes only, on a loopback port."""
    app = FastAPI()
    add_stream_routes(app, store)
    return Server(app)


class _Reader:
    """One SSE reader on a thread: the arrival time of each text event, by its text."""

    def __init__(self, url: str, root: uuid.UUID) -> None:
        self.url, self.root = url, root
        self.arrived: dict[str, float] = {}
        #: The wall clock at each arrival (against the database's created_at).
        self.arrived_wall: dict[str, float] = {}
        self.connected = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.stream("GET", f"{self.url}/trees/{self.root}/stream", timeout=60) as response:
            self.connected.set()
            event = ""
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "text":
                    text = json.loads(line[6:])["text"]
                    self.arrived[text] = time.monotonic()
                    self.arrived_wall[text] = time.time()
                if self.stop.is_set():
                    return

    def __enter__(self) -> _Reader:
        self.thread.start()
        self.connected.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


class _Reconnecting:
    """A reader that drops its connection every ``per`` events and comes back with
    ``Last-Event-ID``, until the stream's end: every id it got, in order."""

    def __init__(self, url: str, root: uuid.UUID, per: int, times: int) -> None:
        self.url, self.root, self.per, self.times = url, root, per, times
        self.ids: list[str] = []
        self.reconnects = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _once(self) -> bool:
        """One connection; True when the stream's end came."""
        headers = {"Last-Event-ID": self.ids[-1]} if self.ids else {}
        got = 0
        with httpx.stream("GET", f"{self.url}/trees/{self.root}/stream", headers=headers,
                          timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("event: end"):
                    return True
                if line.startswith("id: "):
                    self.ids.append(line[4:])
                    got += 1
                    if got >= self.per and self.reconnects < self.times:
                        return False
        return False

    def _run(self) -> None:
        while not self._once():
            self.reconnects += 1


class _HorizonLog:
    """A thread that records (wall clock, xmin) every 2 ms: when each row became readable."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seen: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.store.engine.connect() as conn:
            probe = sa.text("SELECT CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text)")
            while not self.stop.is_set():
                xmin = int(conn.execute(probe).scalar_one())
                conn.commit()
                self.seen.append((time.time(), xmin))
                time.sleep(0.002)

    def readable_at(self, txid: int) -> float | None:
        """The first time xmin was above ``txid``."""
        return next((at for at, xmin in self.seen if xmin > txid), None)


def _cancel(store: Store, root: uuid.UUID) -> None:
    """Cancel the tree (its stream ends with it)."""
    store.steering.cancel(root, actor="bench")


def _tree(store: Store, calls: int) -> tuple[uuid.UUID, list[Any]]:
    """A root that delegated to ``calls`` children, every child claimed."""
    root, _ = store.tasks.submit(NewTask(to_agent="boss", type="task", payload={"goal": "g"}))
    [claimed] = store.claims.claim(["boss"], 1, "bench", 300)
    children = [ChildRow("scout", "task", {"goal": f"part {i}"}, f"k{i}", 100, 60,
                         Decimal("0.01")) for i in range(calls)]
    store.transitions.delegate(root["id"], claimed["lease_token"], children, "bench")
    return root["id"], list(store.claims.claim(["scout"], calls, "bench", 300))


def _quantiles(values: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(values, n=100)
    return round(statistics.median(values), 1), round(cuts[98], 1)


def _through_the_writer(store: Store, url: str, calls: int, tokens: int,
                        tokens_per_second: float) -> dict[str, Any]:
    root, rows = _tree(store, calls)
    writer = TextWriter(store)
    added: dict[str, float] = {}
    firsts: list[str] = []
    lock = threading.Lock()
    gap = 1.0 / tokens_per_second

    def one(row: Any, n: int) -> None:
        stream = writer.open(row["id"], row["lease_token"], "run", 0, CallAttempts())
        time.sleep(gap * n / calls)
        next_at = time.monotonic()
        for i in range(tokens):
            token = f"<{n}:{i}>"
            with lock:
                added[token] = time.monotonic()
                if i == 0:
                    firsts.append(token)
            stream.add(token)
            next_at += gap
            time.sleep(max(0.0, next_at - time.monotonic()))
        stream.end()

    dropping = _Reconnecting(url, root, per=max(1, calls * tokens // 400), times=100)
    dropping.thread.start()
    horizon = _HorizonLog(store)
    horizon.thread.start()
    with _Reader(url, root) as reader:
        threads = [threading.Thread(target=one, args=(row, n)) for n, row in enumerate(rows)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(
                len(t) for t in reader.arrived) < len("".join(added)):
            time.sleep(0.05)
        arrived = dict(reader.arrived)
        arrived_wall = dict(reader.arrived_wall)
        _cancel(store, root)  # the stream ends: the reader's thread with it
    writer.close()
    horizon.stop.set()
    horizon.thread.join(5)
    dropping.thread.join(30)
    whole = [e.id for e in follow(store.streams, root)]
    got = dropping.ids
    first_ms, piece_ms = [], []
    for text, at in arrived.items():
        tokens_in = [t for t in (f"<{t}" for t in text.split("<") if t) if t in added]
        if tokens_in and tokens_in[0] in firsts:
            first_ms.append((at - added[tokens_in[0]]) * 1000)
        piece_ms += [(at - added[t]) * 1000 for t in tokens_in]
    first = _quantiles(first_ms)
    piece = _quantiles(piece_ms)
    with store.engine.connect() as conn:  # each first piece's transaction start
        firsts_db = conn.execute(sa.text(
            'SELECT text, extract(epoch FROM created_at) AS at, CAST(txid AS text) AS txid '
            'FROM call_text WHERE root_id = :root AND attempt = 1 AND "offset" = 0'),
            {"root": root}).all()
    db_ms, held_ms, read_ms = [], [], []
    for row in firsts_db:
        if row.text not in arrived_wall:
            continue
        db_ms.append((arrived_wall[row.text] - float(row.at)) * 1000)
        readable = horizon.readable_at(int(row.txid))
        if readable is not None:
            held_ms.append((readable - float(row.at)) * 1000)
            read_ms.append((arrived_wall[row.text] - readable) * 1000)
    first_db = _quantiles(db_ms)
    held, after = _quantiles(held_ms), _quantiles(read_ms)
    return {"stream_calls": calls, "stream_tokens_per_call": tokens,
            "stream_tokens_per_second_per_call": tokens_per_second,
            "stream_first_texts_seen": len(first_ms),
            "stream_tokens_seen": len(piece_ms), "stream_tokens_sent": len(added),
            "stream_first_text_ms_p50": first[0], "stream_first_text_ms_p99": first[1],
            "stream_first_text_from_write_ms_p50": first_db[0],
            "stream_first_text_from_write_ms_p99": first_db[1],
            "stream_first_text_write_to_readable_ms_p50": held[0],
            "stream_first_text_write_to_readable_ms_p99": held[1],
            "stream_first_text_readable_to_reader_ms_p50": after[0],
            "stream_first_text_readable_to_reader_ms_p99": after[1],
            "stream_piece_ms_p50": piece[0], "stream_piece_ms_p99": piece[1],
            "stream_reconnects": dropping.reconnects,
            "stream_reconnect_events": len(got),
            "stream_reconnect_gaps": len(set(whole) - set(got)),
            "stream_reconnect_duplicates": len(got) - len(set(got)),
            "stream_reconnect_in_order": got == whole}


def _read_side(store: Store, url: str, pieces: int, gap: float) -> dict[str, Any]:
    root, rows = _tree(store, 1)
    insert = sa.text('INSERT INTO call_text (root_id, task_id, phase, call_index, attempt, '
                     '"offset", text) VALUES (:root, :task, \'run\', 0, 1, :offset, :text)')
    committed: dict[str, float] = {}
    with _Reader(url, root) as reader:
        offset = 0
        for i in range(pieces):
            text = f"[{i}]"
            with store.database.transaction() as conn:
                conn.execute(insert, {"root": root, "task": rows[0]["id"], "offset": offset,
                                      "text": text})
            committed[text] = time.monotonic()
            offset += len(text)
            time.sleep(gap)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(reader.arrived) < pieces:
            time.sleep(0.05)
        arrived = dict(reader.arrived)
        _cancel(store, root)
    read_ms = [(arrived[t] - committed[t]) * 1000 for t in committed if t in arrived]
    p50, p99 = _quantiles(read_ms)
    return {"stream_read_pieces": pieces, "stream_read_seen": len(read_ms),
            "stream_read_ms_p50": p50, "stream_read_ms_p99": p99}


def measure(calls: int, tokens: int, tokens_per_second: float, pieces: int, gap: float,
            server: str | None = None) -> dict[str, Any]:
    """Both measures on one scratch database; return the figures."""
    with scratch_database("stream_reads", server) as url:
        store = open_store(url, pool_size=8)
        with _stream_server(store) as http:
            figures = _through_the_writer(store, http.url, calls, tokens, tokens_per_second)
            figures.update(_read_side(store, http.url, pieces, gap))
        store.engine.dispose()
    return figures


def main(calls: int = 100, tokens: int = 40, tokens_per_second: float = 20.0,
         pieces: int = 200, gap: float = 0.013, server: str | None = None) -> dict[str, Any]:
    """Measure and print the figures."""
    return report("stream_reads", measure(calls, tokens, tokens_per_second, pieces, gap,
                                          server))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--tokens-per-second", type=float, default=20.0)
    parser.add_argument("--pieces", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.013)
    parser.add_argument("--server", default=None)
    args = parser.parse_args()
    main(args.calls, args.tokens, args.tokens_per_second, args.pieces, args.gap, args.server)
