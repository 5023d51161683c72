"""Issue 47's measures of streaming, in one run, merged into ``bench/results/latest.json``.

    python -m bench.streaming [--pairs 2] [--pieces 20] [--no-write]

Each figure comes from the bench that measures it (imported, not copied):

- ``stream_first_text_ms`` (``p50``, ``p99``; goal <= 30 / <= 150 ms): :mod:`bench.stream_reads`.
  100 calls stream at once through the worker's text writer at the default
  ``[streaming]`` settings (40 tokens each, 20 a second); from each call's first token
  handed to the writer (what the model server's first piece becomes) to a connected SSE
  reader over real HTTP. That run's reader that drops its connection 100 times and
  comes back with ``Last-Event-ID`` gives ``reconnect_100_calls``;
- ``reconnect`` (``gaps``, ``duplicates`` over 100 reconnects; goal 0 / 0): the same
  reconnecting reader during one more run of the 931-task tree below, streaming on
  (not one of the timed pairs), compared with one whole read of the stream afterwards;
- ``stream_overhead`` (goal <= 1.10): :mod:`bench.makespan`'s 931-task tree (900 calls of
  1 s at once, one worker), streaming off then on, ``--pairs`` times alternating, in the
  same run; the model server streams each call in ``--pieces`` NDJSON pieces over its
  second (``bench.model_server --pieces``). ``ratio`` is the median of on / off per pair;
- ``stream_wal_bytes_per_kb_text`` (goal <= 3 KB): :mod:`bench.stream_writes`, 200 calls
  at once, 2,000 characters each at 50 tokens a second, at the default flush window;
- ``resume_regenerated`` (goal: <= one flush window): a worker SIGKILLed while 20 calls
  stream from the loopback Ollama-compatible server (``tests.fake_ollama``: pieces of 8
  characters every 20 ms), :data:`RESUME_KILL_DELAY` after each has text recorded (so
  the kill lands anywhere in a flush window); a second worker continues each call from
  its recorded text. What the dead worker had received after its last recorded piece,
  per call, is what is generated again: the server's log of the pieces it wrote before
  the kill against the prefix each continued request carried. ``window_chars``: one
  flush window of that stream (``flush_seconds`` of pieces, plus a piece in flight on
  each side);
- ``resume_regenerated_embedded``: the same on the embedded model (two long calls
  generating at once, ``bench.stream_agents``). What the dead worker generated after
  its last piece cannot be seen from outside: it is estimated from the time between
  that piece's transaction and the kill, at the call's own rate (see
  :func:`resume_embedded`); ``window_tokens``: ``flush_seconds`` of that rate plus a
  token in flight on each side.

``--no-write`` prints the figures without merging them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from bench import makespan, stream_reads, stream_writes
from bench.common import (
    REPO_ROOT,
    RESULTS_DIR,
    open_store,
    report,
    scratch_database,
    wait_serving,
    worker_env,
)
from runtime.store.rows import NewTask
from runtime.store.store import Store
from runtime.store.streams import follow
from tests.fake_ollama import FakeOllama

#: The resume measure: calls cut off at once, their pieces, and the stream's window.
RESUME_CALLS = 20
RESUME_PIECE_CHARS = 8
RESUME_PIECE_SECONDS = 0.02
RESUME_FLUSH_SECONDS = 0.1
RESUME_REPLY = ("Durable streams keep every piece of a reply in the database as it "
                "comes, so a reader that joins late sees it from the start, and a worker "
                "that dies mid-reply hands the next one the text it had. ") * 2
CHARS_PER_TOKEN = 4
#: After the calls have text, the kill waits this long: it lands anywhere in a flush window.
RESUME_KILL_DELAY = 0.25


def first_text_and_reconnect(server: str | None) -> dict[str, Any]:
    """``stream_first_text_ms`` and ``reconnect``, from one :mod:`bench.stream_reads` run."""
    got = stream_reads.measure(calls=100, tokens=40, tokens_per_second=20.0, pieces=200,
                               gap=0.013, server=server)
    return {
        "stream_first_text_ms": {
            "p50": got["stream_first_text_ms_p50"], "p99": got["stream_first_text_ms_p99"],
            "calls_at_once": got["stream_calls"], "seen": got["stream_first_texts_seen"],
            "from_write_p50": got["stream_first_text_from_write_ms_p50"],
            "from_write_p99": got["stream_first_text_from_write_ms_p99"],
            "write_to_readable_p50": got["stream_first_text_write_to_readable_ms_p50"],
            "readable_to_reader_p50": got["stream_first_text_readable_to_reader_ms_p50"],
            "piece_p50": got["stream_piece_ms_p50"], "piece_p99": got["stream_piece_ms_p99"],
            "read_side_p50": got["stream_read_ms_p50"],
            "read_side_p99": got["stream_read_ms_p99"]},
        "reconnect_100_calls": {
            "reconnects": got["stream_reconnects"], "gaps": got["stream_reconnect_gaps"],
            "duplicates": got["stream_reconnect_duplicates"],
            "events": got["stream_reconnect_events"],
            "in_order": got["stream_reconnect_in_order"],
            "tree": f"{got['stream_calls']} calls streaming at once"},
    }


def overhead(pairs: int, pieces: int, server: str | None) -> dict[str, Any]:
    """``stream_overhead``: the 931-task tree's makespan, streaming off then on, ``pairs``
    times."""
    off_s: list[float] = []
    on_s: list[float] = []
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(pairs):
        for enabled, into in (("false", off_s), ("true", on_s)):
            got = makespan.measure(server=server, pieces=pieces,
                                   extra_env={"ORGCHART_STREAMING__ENABLED": enabled})
            into.append(got["makespan_seconds"])
            cpu["on" if enabled == "true" else "off"].append(
                got["makespan_worker_cpu_ms_per_task"])
    ratios = [round(on / off, 3) for off, on in zip(off_s, on_s, strict=True)]
    return {"stream_overhead": {
        "ratio": round(statistics.median(ratios), 3), "ratios": ratios,
        "off_seconds": off_s, "on_seconds": on_s, "tasks": 931, "model_delay_seconds": 1.0,
        "pieces_per_call": pieces,
        "worker_cpu_ms_per_task_off": statistics.median(cpu["off"]),
        "worker_cpu_ms_per_task_on": statistics.median(cpu["on"])}}


def reconnect_931(pieces: int, server: str | None) -> dict[str, Any]:
    """``reconnect``: a reader drops and reconnects 100 times during the 931-task tree.

    One more run of :mod:`bench.makespan`'s tree, streaming on (not one of the timed
    pairs): its stream served by uvicorn on loopback, read by :mod:`bench.stream_reads`'
    reconnecting reader (it drops every 40 events and comes back with
    ``Last-Event-ID``), then compared with one whole read of the stream.
    """
    got: dict[str, Any] = {}

    def during(url: str, store: Store, root: uuid.UUID) -> Callable[[], None]:
        http = stream_reads._stream_server(store)
        http.__enter__()
        dropping = stream_reads._Reconnecting(http.url, root, per=40, times=100)
        dropping.thread.start()

        def finish() -> None:
            dropping.thread.join(120)
            whole = [e.id for e in follow(store.streams, root)]
            ids = dropping.ids
            got.update({"reconnects": dropping.reconnects, "gaps": len(set(whole) - set(ids)),
                        "duplicates": len(ids) - len(set(ids)), "events": len(ids),
                        "events_in_the_whole_read": len(whole), "in_order": ids == whole,
                        "tree": "931 tasks, streaming on", "pieces_per_call": pieces})
            http.__exit__(None, None, None)

        return finish

    makespan.measure(server=server, pieces=pieces, during=during)
    return {"reconnect": got}


def wal(server: str | None) -> dict[str, Any]:
    """``stream_wal_bytes_per_kb_text`` from :mod:`bench.stream_writes` (its defaults)."""
    got = stream_writes.measure(calls=200, chars=2000, tokens_per_second=50.0, server=server)
    return {"stream_wal_bytes_per_kb_text": got["stream_wal_bytes_per_kb_text"],
            "stream_wal_detail": {k: got[k] for k in (
                "stream_calls", "stream_flush_seconds", "stream_flush_chars",
                "stream_rows_per_call", "stream_chars_per_row", "stream_rows_per_second",
                "stream_finish_ms_p50", "stream_finish_ms_p99")}}


def _recorded(store: Store) -> dict[str, int]:
    """Characters recorded per task (its one call)."""
    with store.engine.connect() as conn:
        return {str(r.task_id): int(r.chars) for r in conn.execute(sa.text(
            "SELECT task_id, sum(char_length(text)) AS chars FROM call_text "
            "WHERE phase = 'run' GROUP BY task_id"))}


def _open_tasks(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM tasks WHERE status NOT IN "
            "('done', 'failed', 'escalated', 'cancelled')")).scalar_one())


def _worker(url: str, settings: dict[str, str], agents: str, module: str,
            lines: list[str]) -> subprocess.Popen[str]:
    """Start one ``orgchart worker`` with ``settings`` (environment); wait until it serves."""
    env = worker_env(url)
    env.update(settings)
    proc = subprocess.Popen(
        [sys.executable, "-c", makespan.WORKER_BOOT, "worker", "--agents", agents,
         "--agents-module", module, "--lease-seconds", "2"],
        env=env, cwd=str(REPO_ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    wait_serving(proc, lines, 120)
    return proc


def _ollama_worker(url: str, model_url: str, lines: list[str]) -> subprocess.Popen[str]:
    return _worker(url, {"ORGCHART_LLM__BACKEND": "ollama", "ORGCHART_OLLAMA__URL": model_url,
                         "ORGCHART_OLLAMA__MAX_PARALLEL": "100",
                         "ORGCHART_OLLAMA__CLOUD_MAX_PARALLEL": "100",
                         "ORGCHART_STREAMING__FLUSH_SECONDS": str(RESUME_FLUSH_SECONDS)},
                   "spender,judge", "tests.chaos.agents", lines)


def _stop(workers: list[subprocess.Popen[str]]) -> None:
    """Ask the workers still running to end, and wait for them."""
    for proc in workers:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


def _until(what: str, check: Any, timeout: float, lines: list[str],
           interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}; the workers' log ends:\n"
                               + "".join(lines[-20:]))
        time.sleep(interval)


def resume(server: str | None) -> dict[str, Any]:
    """``resume_regenerated``: text made again after a SIGKILL mid-generation."""
    fake = FakeOllama().start()
    fake.reply_text = RESUME_REPLY
    fake.piece_chars = RESUME_PIECE_CHARS
    fake.piece_delay_seconds = RESUME_PIECE_SECONDS
    workers: list[subprocess.Popen[str]] = []
    lines: list[str] = []
    try:
        with scratch_database("stream_resume", server) as url:
            store = open_store(url)
            for i in range(RESUME_CALLS):
                store.tasks.submit(NewTask(to_agent="spender", type="task",
                                     payload={"goal": f"stream {i}"}))
            workers.append(_ollama_worker(url, fake.url, lines))
            _until("every call to have text recorded", lambda: len(_recorded(store))
                   >= RESUME_CALLS and min(_recorded(store).values())
                   >= 4 * RESUME_PIECE_CHARS, 60, lines)
            time.sleep(RESUME_KILL_DELAY)
            if fake.sent_log:
                raise RuntimeError("a reply was complete before the kill")
            killed_at = time.time()
            workers[0].send_signal(signal.SIGKILL)
            workers[0].wait(10)
            at_kill = _recorded(store)
            workers.append(_ollama_worker(url, fake.url, lines))
            _until("every task to finish", lambda: _open_tasks(store) == 0, 120, lines, 0.1)
            with store.engine.connect() as conn:
                attempts = conn.execute(sa.text(
                    "SELECT max(attempt) FROM call_text")).scalar_one()
            store.engine.dispose()
    finally:
        _stop(workers)
        fake.stop()
    received: dict[str, int] = {}
    for user, at, chars in fake.piece_log:
        if at <= killed_at:
            received[user] = received.get(user, 0) + chars
    again = sorted(received.get(user, 0) - start for user, start in fake.continued)
    window = (RESUME_FLUSH_SECONDS / RESUME_PIECE_SECONDS + 2) * RESUME_PIECE_CHARS
    return {"resume_regenerated": {
        "backend": "ollama (tests.fake_ollama on loopback)", "calls": RESUME_CALLS,
        "continued": len(fake.continued), "max_attempt": attempts,
        "recorded_at_kill_chars_p50": statistics.median(at_kill.values()),
        "chars_max": again[-1] if again else None,
        "chars_p50": statistics.median(again) if again else None,
        "tokens_max_estimated": round(again[-1] / CHARS_PER_TOKEN) if again else None,
        "flush_seconds": RESUME_FLUSH_SECONDS,
        "stream_chars_per_second": RESUME_PIECE_CHARS / RESUME_PIECE_SECONDS,
        "window_chars": window, "within_window": bool(again) and again[-1] <= window}}


def _pieces_by_call(store: Store) -> dict[str, list[Any]]:
    """Each task's call's pieces, by offset: (created_at epoch, characters, attempt, token)."""
    by: dict[str, list[Any]] = {}
    with store.engine.connect() as conn:
        for row in conn.execute(sa.text(
                'SELECT task_id, extract(epoch FROM created_at) AS at, char_length(text) AS n, '
                'attempt, lease_token, text FROM call_text WHERE phase = \'run\' '
                'ORDER BY task_id, "offset"')):
            by.setdefault(str(row.task_id), []).append(row)
    return by


def resume_embedded(server: str | None, calls: int = 2,
                    max_tokens: int = 400) -> dict[str, Any]:
    """``resume_regenerated_embedded``: the embedded model SIGKILLed mid-generation.

    ``calls`` long free-text calls (``bench.stream_agents``) generate at once; once each has
    some text recorded the worker is SIGKILLed and a second one continues them. What the
    dead worker generated after its last recorded piece is not observable from outside,
    so it is estimated: the time from that piece's transaction start to the kill, at the
    call's own generation rate (its recorded characters over the time they took), in
    tokens at the reply's characters per token.
    """
    workers: list[subprocess.Popen[str]] = []
    lines: list[str] = []
    settings = {"ORGCHART_LLM__BACKEND": "embedded",
                "ORGCHART_EMBEDDED__MAX_PARALLEL": str(calls),
                "ORGCHART_STREAMING__FLUSH_SECONDS": str(RESUME_FLUSH_SECONDS)}
    try:
        with scratch_database("stream_resume_embedded", server) as url:
            store = open_store(url)
            for i in range(calls):
                store.tasks.submit(NewTask(to_agent="long_writer", type="task", payload={
                    "goal": f"durable queues, part {i}", "max_tokens": max_tokens}))
            workers.append(_worker(url, settings, "long_writer,judge",
                                   "bench.stream_agents", lines))

            def started() -> bool:
                got = _pieces_by_call(store)
                return len(got) >= calls and min(sum(r.n for r in rows)
                                                 for rows in got.values()) >= 200
            _until("every call to have text recorded", started, 180, lines)
            time.sleep(RESUME_KILL_DELAY)
            killed_at = time.time()
            workers[0].send_signal(signal.SIGKILL)
            workers[0].wait(10)
            at_kill = _pieces_by_call(store)
            workers.append(_worker(url, settings, "long_writer,judge",
                                   "bench.stream_agents", lines))
            _until("every task to finish", lambda: _open_tasks(store) == 0, 300, lines, 0.2)
            after = _pieces_by_call(store)
            with store.engine.connect() as conn:
                replies = {str(r.task_id): r for r in conn.execute(sa.text(
                    "SELECT task_id, response, completion_tokens FROM model_calls "
                    "WHERE phase = 'run' AND error IS NULL"))}
            store.engine.dispose()
    finally:
        _stop(workers)
    lag_ms, again_tokens, window_tokens, rates = [], [], [], []
    continued = 0
    for task, rows in at_kill.items():
        reply = replies.get(task)
        whole = after.get(task, [])
        recorded = "".join(r.text for r in rows)
        if reply is None or len(rows) < 2:
            continue
        if ({r.attempt for r in whole} == {1} and len({r.lease_token for r in whole}) == 2
                and str(reply.response).startswith(recorded)):
            continued += 1
        took = float(rows[-1].at) - float(rows[0].at)
        rate = sum(r.n for r in rows[1:]) / took if took > 0 else 0.0  # chars a second
        per_token = len(str(reply.response)) / max(1, int(reply.completion_tokens))
        lag = killed_at - float(rows[-1].at)
        lag_ms.append(round(lag * 1000))
        rates.append(round(rate / per_token, 1))
        again_tokens.append(round(lag * rate / per_token, 1))
        # One flush window of generation, plus a token in flight on each side.
        window_tokens.append(round(RESUME_FLUSH_SECONDS * rate / per_token + 2, 1))
    return {"resume_regenerated_embedded": {
        "backend": "embedded (SmolLM2-135M-Instruct, llama.cpp)", "calls": calls,
        "continued_in_the_same_attempt": continued,
        "kill_after_last_piece_ms": lag_ms, "tokens_per_second": rates,
        "tokens_estimated": again_tokens, "window_tokens": window_tokens,
        "flush_seconds": RESUME_FLUSH_SECONDS,
        "within_window": bool(again_tokens) and all(
            a <= w for a, w in zip(again_tokens, window_tokens, strict=True))}}


def merge(figures: dict[str, Any]) -> None:
    """Merge ``figures`` into ``bench/results/latest.json``, keeping the other keys."""
    path = RESULTS_DIR / "latest.json"
    latest = json.loads(path.read_text()) if path.exists() else {}
    latest.update(figures)
    latest["streaming_measured_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    latest["streaming_load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path.write_text(json.dumps(latest, indent=2) + "\n")


def main(pairs: int = 2, pieces: int = 20, server: str | None = None,
         write: bool = True) -> dict[str, Any]:
    """Measure all of issue 47's figures; print them; merge them unless ``write`` is False."""
    load_before = [round(x, 2) for x in os.getloadavg()]
    figures: dict[str, Any] = {}
    figures.update(first_text_and_reconnect(server))
    figures.update(wal(server))
    figures.update(resume(server))
    figures.update(resume_embedded(server))
    figures.update(overhead(pairs, pieces, server))
    figures.update(reconnect_931(pieces, server))
    figures["streaming_load_average_at_start"] = load_before
    if write:
        merge(figures)
    return report("streaming (issue 47)", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--pieces", type=int, default=20)
    parser.add_argument("--server", default=None)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    main(args.pairs, args.pieces, args.server, not args.no_write)
