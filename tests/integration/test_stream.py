"""A tree's stream (issue 47, the read side) on the real test database.

``GET /trees/{root_id}/stream`` served by uvicorn and read over HTTP with reconnects
(``Last-Event-ID``: no gap, no duplicate, the text equal to what was written), two
writers committing out of id order, the end after the root's terminal transition, a
newer attempt superseding an older one, ``orgchart follow`` and the client's iterators.
Pieces are written into ``call_text`` as the model layer writes them (one row per
piece, in its own transaction).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from orgchart import AsyncClient, Client
from orgchart.transports import sse_messages
from runtime.cli.app import app
from runtime.cli.render import StreamPrinter
from runtime.http.api import create_app
from runtime.store.postgres.urls import libpq_url
from runtime.store.rows import NewTask
from runtime.store.store import Store
from runtime.store.streams import START, Position, StreamEvent, StreamReader, follow
from runtime.wiring import Runtime
from tests.asgi_server import Server
from tests.support import drain

_PIECE = sa.text(
    'INSERT INTO call_text (root_id, task_id, phase, call_index, attempt, "offset", text) '
    "VALUES (:root, :task, :phase, :call, :attempt, :offset, :text)")
_PIECE_PG = ('INSERT INTO call_text (root_id, task_id, phase, call_index, attempt, "offset", '
             "text) VALUES (%s, %s, 'run', 0, 1, %s, %s)")


def _submit(store: Store, agent: str = "echo") -> uuid.UUID:
    task, _ = store.tasks.submit(NewTask(agent, "task", {"goal": "stream me"}))
    return uuid.UUID(str(task["id"]))


def _piece(store: Store, root: uuid.UUID, text: str, offset: int, *, task: uuid.UUID | None = None,
           call: int = 0, attempt: int = 1, phase: str = "run") -> None:
    with store.database.transaction() as conn:
        conn.execute(_PIECE, {"root": root, "task": task or root, "phase": phase, "call": call,
                              "attempt": attempt, "offset": offset, "text": text})


def _cancel(store: Store, root: uuid.UUID) -> None:
    """Cancel a tree and its stream's end with it."""
    store.steering.cancel(root, actor="test")


def _texts(events: list[StreamEvent]) -> dict[tuple[str, int, int], str]:
    """The text of each (task, call, attempt), joined in offset order, checked contiguous."""
    joined: dict[tuple[str, int, int], str] = {}
    for e in events:
        if e.kind == "text":
            key = (e.data["task_id"], e.data["call"], e.data["attempt"])
            assert e.data["offset"] == len(joined.get(key, "")), "a gap or a repeat in the text"
            joined[key] = joined.get(key, "") + e.data["text"]
    return joined


def _ordered_once(events: list[StreamEvent]) -> None:
    ids = [e.id for e in events]
    assert len(ids) == len(set(ids)), "an event came twice"
    positions = [e.position for e in events]
    assert positions == sorted(positions), "events out of their order"


# ---------------------------------------------------------------------- cursors
def test_event_ids_round_trip_and_a_bad_one_is_refused() -> None:
    from runtime.errors import BadInput

    for text in ("4051.s3", "4051.t3", "0.e17"):
        assert str(Position.parse(text)) == text
    assert Position.parse(None) == START == Position.parse("")
    assert Position.parse("9.s3") < Position.parse("9.t3") < Position.parse("9.e1")
    assert Position.parse("9.e1") < Position.parse("10.t0")
    for bad in ("x", "1.q2", "1.t", "-1.t2", "1.t9999999999999999999"):
        with pytest.raises(BadInput):
            Position.parse(bad)


def test_sse_messages_are_parsed_as_eventsource_does() -> None:
    lines = ["retry: 1000", "", ": keepalive", "", "id: 5.t1", "event: text",
             'data: {"a":1}', "", "event: end", "data: {}", ""]
    assert list(sse_messages(lines)) == [("text", "5.t1", '{"a":1}'), ("end", None, "{}")]


# ---------------------------------------------------------------------- the reader
def test_the_stream_reads_text_and_transitions_then_ends(store: Store) -> None:
    root = _submit(store)
    words = ["Durable ", "agents ", "stream\n", "their ", "thoughts."]
    offset = 0
    for word in words:
        _piece(store, root, word, offset)
        offset += len(word)
    _cancel(store, root)
    _piece(store, root, " after the end", offset)  # a later transaction: never shown
    events = list(follow(store.streams, root))
    _ordered_once(events)
    assert _texts(events) == {(str(root), 0, 1): "".join(words)}
    transitions = [(e.data["from"], e.data["to"]) for e in events if e.kind == "transition"]
    assert transitions == [(None, "pending"), ("pending", "cancelled")]
    assert events[-1].kind == "transition" and events[-1].data["to"] == "cancelled"
    # A reader that comes back after the end gets nothing more, and ends at once.
    assert list(follow(store.streams, root, events[-1].position)) == []
    # ... and one that comes back from the middle gets exactly the rest.
    rest = list(follow(store.streams, root, events[2].position))
    assert [e.id for e in rest] == [e.id for e in events[3:]]


def test_two_writers_committing_out_of_id_order_lose_no_row(store: Store, db_url: str) -> None:
    root = _submit(store)
    reader = store.streams
    seen = [e for e in reader.read(root, START).events]
    cursor = seen[-1].position
    with psycopg.connect(libpq_url(db_url)) as first, psycopg.connect(libpq_url(db_url)) as second:
        first.execute(_PIECE_PG, (root, root, 0, "lower id, "))   # id n, still open
        second.execute(_PIECE_PG, (root, root, 10, "higher id"))  # id n+1
        second.commit()  # the later id commits first
        page = reader.read(root, cursor)
        assert page.events == [], "a row read past a transaction still open"
        first.commit()
    # Now both, the lower id first, and nothing skipped.
    page = reader.read(root, cursor)
    assert [e.data["text"] for e in page.events] == ["lower id, ", "higher id"]
    # The other way round: the transaction with the lower txid writes the higher id.
    cursor = page.events[-1].position
    with psycopg.connect(libpq_url(db_url)) as early, psycopg.connect(libpq_url(db_url)) as late:
        early.execute("SELECT pg_current_xact_id()")              # the lower txid
        late.execute(_PIECE_PG, (root, root, 19, "late txid, low id"))
        early.execute(_PIECE_PG, (root, root, 36, "early txid, high id"))
        early.commit()
        got = reader.read(root, cursor).events
        assert [e.data["text"] for e in got] == ["early txid, high id"]
        cursor = got[-1].position
        late.commit()
    assert [e.data["text"] for e in reader.read(root, cursor).events] == ["late txid, low id"]


_EVENT_PG = ("INSERT INTO task_events (task_id, from_status, to_status) "
             "VALUES (%s, 'pending', %s)")


def test_a_read_from_the_last_horizon_loses_no_transition(store: Store, db_url: str) -> None:
    """After a read that was not a full page, the next reads only transitions from its
    xmin on (the ``(txid, id)`` index): one whose transaction was open across a read is
    still read, in order, and another tree's are not."""
    root, other = _submit(store), _submit(store)
    reader = store.streams
    first = reader.read(root, START)
    assert not first.full and first.xmin > 0
    cursor, seen = first.events[-1].position, first.xmin
    with psycopg.connect(libpq_url(db_url)) as early, psycopg.connect(libpq_url(db_url)) as late:
        early.execute("SELECT pg_current_xact_id()")  # the lower txid, open across reads
        late.execute(_EVENT_PG, (root, "waiting"))
        late.execute(_EVENT_PG, (other, "waiting"))
        late.commit()
        held = reader.read(root, cursor, seen)
        assert held.events == [], "a row read past a transaction still open"
        assert held.xmin <= int(early.execute("SELECT pg_current_xact_id()::text")
                                .fetchone()[0])  # type: ignore[index]
        early.execute(_EVENT_PG, (root, "running"))
        early.commit()
    page = reader.read(root, cursor, held.xmin)
    assert [e.data["to"] for e in page.events] == ["running", "waiting"]  # by txid
    assert page.events == reader.read(root, cursor).events  # as a read per task has it
    assert reader.read(root, page.events[-1].position, page.xmin).events == []


def test_a_newer_attempt_supersedes_the_older_one(store: Store) -> None:
    root = _submit(store)
    _piece(store, root, "The ans", 0)
    _piece(store, root, "wer is", 7)
    _piece(store, root, "Fresh start", 0, attempt=2)
    _piece(store, root, " from a lost lease", 13)  # attempt 1, late: left out
    _piece(store, root, ".", 11, attempt=2)
    _cancel(store, root)
    events = list(follow(store.streams, root))
    _ordered_once(events)
    kinds = [e.kind for e in events]
    assert kinds == ["transition", "text", "text", "superseded", "text", "text", "transition"]
    superseded = events[3]
    assert superseded.data == {"task_id": str(root), "phase": "run", "call": 0,
                               "attempt": 1, "by": 2}
    assert superseded.id.split(".")[1].startswith("s")
    assert _texts(events) == {(str(root), 0, 1): "The answer is",
                              (str(root), 0, 2): "Fresh start."}


def test_the_stream_ends_after_the_roots_terminal_transition(runtime: Runtime) -> None:
    root = _submit(runtime.store, "fanout")
    drain(runtime)
    assert runtime.store.reads.get(root)["status"] == "done"
    events = list(follow(runtime.store.streams, root))
    _ordered_once(events)
    last = [e for e in events if e.kind == "transition"][-1]
    assert last.data["task_id"] == str(root) and last.data["to"] == "done"
    assert events[-1].position.txid == last.position.txid  # nothing after its transaction
    children = {e.data["task_id"] for e in events if e.kind == "transition"} - {str(root)}
    assert len(children) >= 1


# ---------------------------------------------------------------------- over HTTP
def _read_sse(url: str, root: uuid.UUID, last: str | None, limit: int | None
              ) -> tuple[list[StreamEvent], bool]:
    """Read the stream over HTTP, at most ``limit`` events; (events, ended)."""
    headers = {"Last-Event-ID": last} if last else {}
    got: list[StreamEvent] = []
    with httpx.stream("GET", f"{url}/trees/{root}/stream", headers=headers,
                      timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for kind, event_id, data in sse_messages(response.iter_lines()):
            if kind == "end":
                assert json.loads(data)["status"] == "cancelled"
                return got, True
            assert event_id is not None
            got.append(StreamEvent(kind, Position.parse(event_id), json.loads(data)))
            if limit is not None and len(got) >= limit:
                return got, False
    return got, False


def test_the_sse_stream_resumes_with_last_event_id(runtime: Runtime) -> None:
    store = runtime.store
    root = _submit(store)
    written: dict[tuple[str, int, int], str] = {}

    def write() -> None:
        """Three calls streaming at once, 40 pieces each, then the root cancelled."""
        for i in range(40):
            for call in range(3):
                key = (str(root), call, 1)
                text = f"<{call}:{i}>"
                _piece(store, root, text, len(written.get(key, "")), call=call)
                written[key] = written.get(key, "") + text
            time.sleep(0.005)
        _cancel(store, root)

    with Server(create_app(store=store, settings=runtime.settings, registry=runtime.registry,
                           api_token="")) as server:
        writer = threading.Thread(target=write)
        writer.start()
        events: list[StreamEvent] = []
        last, ended, reconnects = None, False, 0
        while not ended:
            page, ended = _read_sse(server.url, root, last, None if reconnects >= 6 else 17)
            events += page
            last = events[-1].id if events else None
            reconnects += 1
        writer.join()
    assert reconnects >= 7
    _ordered_once(events)
    assert _texts(events) == written
    assert [e.id for e in events] == [e.id for e in follow(store.streams, root)]


def test_the_stream_refuses_a_missing_tree_and_a_bad_id(client: Any, runtime: Runtime) -> None:
    assert client.get(f"/trees/{uuid.uuid4()}/stream").status_code == 404
    root = _submit(runtime.store)
    response = client.get(f"/trees/{root}/stream", headers={"Last-Event-ID": "nope"})
    assert response.status_code == 422 and "Last-Event-ID" in response.json()["error"]


def test_the_stream_takes_the_token_in_the_query(runtime: Runtime) -> None:
    from fastapi.testclient import TestClient

    root = _submit(runtime.store)
    _cancel(runtime.store, root)
    with TestClient(create_app(store=runtime.store, settings=runtime.settings,
                               registry=runtime.registry, api_token="s3cret")) as c:
        assert c.get(f"/trees/{root}/stream?token=s3cret").status_code == 200  # EventSource
        assert c.get(f"/trees/{root}/stream?token=wrong").status_code == 401
        assert c.get(f"/trees/{root}/events?token=s3cret").status_code == 401  # only there


# ---------------------------------------------------------------------- faces
@pytest.fixture
def finished(runtime: Runtime) -> Iterator[uuid.UUID]:
    """A root cancelled after its call streamed two pieces."""
    root = _submit(runtime.store)
    _piece(runtime.store, root, "Hello, ", 0)
    _piece(runtime.store, root, "world", 7)
    _cancel(runtime.store, root)
    yield root


def test_orgchart_follow_prints_a_finished_tree(orgchart_env: dict[str, str],
                                                finished: uuid.UUID) -> None:
    result = CliRunner().invoke(app, ["follow", str(finished)])
    assert result.exit_code == 1, result.output  # the root ended cancelled, not done
    assert "Hello, world" in result.stdout
    assert "pending -> cancelled" in result.stdout
    quiet = CliRunner().invoke(app, ["follow", str(finished)[:8], "--quiet"])
    assert "Hello" not in quiet.stdout and "cancelled" in quiet.stderr
    lines = CliRunner().invoke(app, ["follow", str(finished), "--json"]).stdout.splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["event"] for e in events] == ["transition", "text", "text", "transition"]
    resumed = CliRunner().invoke(app, ["follow", str(finished), "--json",
                                       "--after", events[1]["id"]]).stdout.splitlines()
    assert [json.loads(line)["id"] for line in resumed] == [e["id"] for e in events[2:]]


def test_the_clients_iterate_over_the_stream(db_url: str, finished: uuid.UUID,
                                             client: Any) -> None:
    with Client(db_url) as db:
        events = list(db.stream(finished))
        assert "".join(e.data["text"] for e in events if e.kind == "text") == "Hello, world"
        assert [e.id for e in db.stream(str(finished), after=events[1].id)] == \
            [e.id for e in events[2:]]
    over_http = Client.http("http://testserver", http_client=client)
    assert [e.id for e in over_http.stream(finished)] == [e.id for e in events]

    async def read_async() -> list[str]:
        async with AsyncClient(db_url) as aio:
            return [e.id async for e in aio.stream(finished, after=events[0].id)]

    assert asyncio.run(read_async()) == [e.id for e in events[1:]]


def test_the_async_iterator_sees_text_as_it_is_written(db_url: str, store: Store) -> None:
    root = _submit(store)

    async def read() -> list[float]:
        delays: list[float] = []
        async with AsyncClient(db_url) as aio:
            sent: dict[str, float] = {}

            def write() -> None:
                for i in range(20):
                    sent[f"piece {i};"] = time.monotonic()
                    _piece(store, root, f"piece {i};", sum(len(f"piece {j};") for j in range(i)))
                    time.sleep(0.01)
                _cancel(store, root)

            writer = threading.Thread(target=write)
            writer.start()
            async for event in aio.stream(root):
                if event.kind == "text":
                    delays.append(time.monotonic() - sent[event.data["text"]])
            writer.join()
        return delays

    delays = asyncio.run(read())
    assert len(delays) == 20
    assert sorted(delays)[10] < 0.5  # a loose bound: the figure is in the report


def test_orgchart_run_prints_the_live_text_unless_quiet(orgchart_env: dict[str, str]) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runtime.cli.app", "run", *args],
                              env=orgchart_env, capture_output=True, text=True, timeout=120,
                              check=False)

    ran = run("Assess the market for durable agent runtimes")
    assert ran.returncode == 0, ran.stderr
    assert "ceo " in ran.stderr and "run call 0:\n{" in ran.stderr  # the text, on stderr
    assert "ceo " in ran.stderr and ": running -> done" in ran.stderr
    assert ran.stdout.split("\nanswer\n", 1)[1].startswith("summary: offline: ")
    assert ran.stderr.strip().splitlines()[-1].startswith("critical path ")
    quiet = run("Assess the market for durable agent runtimes", "--quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.startswith("answer\nsummary: offline: ")
    assert "call 0" not in quiet.stderr and "critical path" not in quiet.stderr


def test_the_printer_holds_whole_lines_for_a_live_tree() -> None:
    written: list[str] = []
    printer = StreamPrinter(written.append, whole_lines=True, transitions=False)
    task = str(uuid.uuid4())

    def text(piece: str, offset: int, attempt: int = 1) -> StreamEvent:
        return StreamEvent("text", START, {"task_id": task, "phase": "run", "call": 0,
                                           "attempt": attempt, "offset": offset, "text": piece})

    printer.show(StreamEvent("transition", START, {"task_id": task, "from": None,
                                                   "to": "pending", "at": None,
                                                   "agent": "ceo"}))
    printer.show(text("first li", 0))
    printer.show(text("ne\nsecond", 8))
    printer.show(StreamEvent("superseded", START, {"task_id": task, "phase": "run", "call": 0,
                                                   "attempt": 1, "by": 2}))
    printer.show(text("again", 0, attempt=2))
    printer.finish()
    assert "".join(written) == (
        f"ceo {task[:8]} run call 0:\n  first line\n  second\n"
        f"ceo {task[:8]}: run call 0: attempt 1 superseded by attempt 2\n"
        f"ceo {task[:8]} run call 0, attempt 2:\n  again\n")


class _Session:
    """The MCP session's one call ``wait_with_progress`` makes: the notifications, recorded."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, float | None, str | None]] = []

    async def send_progress_notification(self, token: Any, progress: float,
                                         total: float | None = None, message: str | None = None,
                                         related_request_id: str | None = None) -> None:
        self.sent.append((progress, total, message))


def test_mcp_submit_goal_with_wait_sends_the_text_as_progress(store: Store) -> None:
    import anyio

    from runtime.mcp import server

    root = _submit(store)
    session = _Session()
    ctx = type("Ctx", (), {"meta": {"progress_token": "p"}, "request_id": 7,
                           "session": session})()

    def write() -> None:
        time.sleep(0.3)
        text = ""
        for word in ["Durable ", "and ", "resumable."]:
            _piece(store, root, word, len(text))
            text += word
            time.sleep(0.15)
        _piece(store, root, "Again", 0, attempt=2)
        time.sleep(0.2)
        _cancel(store, root)

    writer = threading.Thread(target=write)
    writer.start()
    ended = anyio.run(server.wait_with_progress, ctx, store, root, 30.0)
    writer.join()
    assert ended is True
    messages = [m or "" for _, _, m in session.sent]
    texts = [m.split(": ", 1)[1] for m in messages if " run call 0: " in m]
    assert "".join(texts[:-2]) == "Durable and resumable."
    assert texts[-2:] == ["attempt 1 superseded by attempt 2", "Again"]
    assert all(m.startswith(f"echo {str(root)[:8]} run call 0: ")
               for m in messages if " call 0: " in m)
    values = [p for p, _, _ in session.sent]
    assert values == sorted(values), "progress went back"
    assert session.sent[-1] == (1, 1, "root cancelled: 1 of 1 tasks ended")


def test_the_end_waits_for_a_root_event_written_under_an_older_txid(store: Store,
                                                                      db_url: str) -> None:
    root = _submit(store)
    event = ("INSERT INTO task_events (task_id, from_status, to_status) "
             "VALUES (%s, %s, %s)")
    with psycopg.connect(libpq_url(db_url)) as early, psycopg.connect(libpq_url(db_url)) as late:
        early.execute("SELECT pg_current_xact_id()")   # takes its txid first
        late.execute(event, (root, "pending", "running"))
        late.commit()                                   # the newer txid, the lower id
        early.execute(event, (root, "running", "done"))  # the older txid, the newest event
        early.commit()
    events = list(follow(store.streams, root))
    assert [(e.data["from"], e.data["to"]) for e in events] == [
        (None, "pending"), ("running", "done"), ("pending", "running")]


def test_an_escalated_root_ends_the_stream_and_a_retry_goes_on(store: Store) -> None:
    root = _submit(store)

    def event(before: str, after: str) -> None:
        with store.database.transaction() as conn:
            conn.execute(sa.text("INSERT INTO task_events (task_id, from_status, to_status) "
                                 "VALUES (:t, :a, :b)"), {"t": root, "a": before, "b": after})

    event("pending", "escalated")
    reader = store.streams
    first = list(follow(reader, root))
    assert [e.data["to"] for e in first] == ["pending", "escalated"]
    event("escalated", "pending")  # a person said retry
    _piece(store, root, "second try", 0)
    event("pending", "done")
    rest = list(follow(reader, root, first[-1].position))
    assert [(e.kind, e.data.get("to") or e.data.get("text")) for e in rest] == [
        ("transition", "pending"), ("text", "second try"), ("transition", "done")]


class _CuttingProxy:
    """A TCP proxy that cuts its first ``cuts`` connections after ``after`` bytes back."""

    def __init__(self, upstream: str, cuts: int, after: int) -> None:
        import socket

        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.cuts, self.after, self.cut = cuts, after, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            limit = self.after if self.cut < self.cuts else None
            self.cut += limit is not None
            threading.Thread(target=self._pump, args=(client, server, None),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, limit),
                             daemon=True).start()

    @staticmethod
    def _pump(source: Any, sink: Any, limit: int | None) -> None:
        sent = 0
        try:
            while chunk := source.recv(4096):
                if limit is not None and sent + len(chunk) >= limit:
                    sink.sendall(chunk[:limit - sent])
                    break
                sink.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the other side closed: close both
        import socket

        for end in (source, sink):  # shutdown first: it wakes the other pump's recv
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                end.close()

    def close(self) -> None:
        self.sock.close()


def test_the_http_client_resumes_a_cut_stream_with_last_event_id(runtime: Runtime) -> None:
    store = runtime.store
    root = _submit(store)
    words = [f"word{i} " for i in range(60)]

    def write() -> None:
        text = ""
        for word in words:
            _piece(store, root, word, len(text))
            text += word
            time.sleep(0.01)
        _cancel(store, root)

    with Server(create_app(store=store, settings=runtime.settings, registry=runtime.registry,
                           api_token="")) as server:
        proxy = _CuttingProxy(server.url, cuts=4, after=1500)
        writer = threading.Thread(target=write)
        writer.start()
        try:
            with Client.http(proxy.url) as over_http:
                events = list(over_http.stream(root))
        finally:
            writer.join()
            proxy.close()
    assert proxy.cut == 4
    _ordered_once(events)
    assert _texts(events) == {(str(root), 0, 1): "".join(words)}
    assert [e.id for e in events] == [e.id for e in follow(store.streams, root)]


def test_one_horizon_probe_serves_every_stream_of_the_process(store: Store) -> None:
    from runtime.store.streams import Horizon

    class Counting(StreamReader):
        probes = 0

        def probe(self) -> int:
            Counting.probes += 1
            return super().probe()

    horizon = Horizon(Counting(store.database), poll_seconds=0.01)
    for _ in range(10):  # ten streams
        horizon.subscribe()
    deadline = time.monotonic() + 10
    while horizon.value() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    assert Counting.probes <= 40  # one loop: about 30 probes, not 10 x 30
    for _ in range(10):
        horizon.unsubscribe()
    time.sleep(0.1)
    assert horizon.value() is None  # the thread stopped with the last stream
    stopped_at = Counting.probes
    time.sleep(0.1)
    assert Counting.probes == stopped_at
