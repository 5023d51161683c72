"""Run each runtime's tree and chain in a process of its own, measure it, crash it.

For every runtime (orgchart; LangGraph in its default ``async`` durability and its most
durable, ``sync``; DBOS) and client (``shared``, then ``ollama``: see
:mod:`bench.peers.shape`), in a fresh scratch database on the same server and against a
fresh ``bench.model_server``:

- the tree: makespan (from the go to the root's answer) over the critical path (two
  calls), peak calls in flight at the server, the process's CPU and peak RSS, and the
  database's cost per model call: rows written (``pg_stat_user_tables``), WAL bytes
  (``pg_current_wal_lsn()`` deltas: the whole server's, so run it on a quiet one) and the
  PostgreSQL server's CPU (``bench.common.server_cpu_seconds``);
- with the shared client only: the tree again, SIGKILLed once half the writers' calls
  have been answered at the server, restarted as its docs say; calls made again (at the
  server), answers durable at the kill and when the successor starts (from the runtime's
  own tables), calls in flight at the kill (answered but not durable, or not yet
  answered), and the makespan with the restart; and the chain: makespan minus the
  model's delays, per level.

The orgchart process is one ``orgchart worker`` (its tasks submitted by this process)
and its recorder process (runtime/llm/recorder.py), measured together (CPU, RSS); the
peers' is :mod:`bench.peers.child`. orgchart is crashed twice: the worker alone
(SIGKILL of its pid, as the OOM killer or ``kill -9`` does: its recorder lives on and
records what arrived), and the worker with its recorder (SIGKILL of its process group:
``crash_group_*`` figures).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench.common import (
    REPO_ROOT,
    child_pids,
    connect,
    open_store,
    scratch_database,
    server_cpu_seconds,
    tree_cpu_seconds,
    wait_serving,
    worker_env,
)
from bench.makespan import TERMINAL, WORKER_BOOT, _get, _vm_kb, start_model_server
from bench.makespan import _timeline as makespan_timeline
from bench.peers import orgchart_tree
from bench.peers.shape import Shape, code_lines
from runtime.store.postgres import urls

PEERS_DIR = Path(__file__).resolve().parent
#: No run may take longer (seconds, restart included).
RUN_TIMEOUT = 600.0


@dataclass(frozen=True)
class Runtime:
    """One runtime as measured: its label, package, option (durability) and tree module."""

    label: str
    runtime: str
    option: str
    module: str


RUNTIMES = (
    Runtime("orgchart", "orgchart", "-", "orgchart_tree.py"),
    Runtime("langgraph", "langgraph", "async", "langgraph_tree.py"),
    Runtime("langgraph_sync", "langgraph", "sync", "langgraph_tree.py"),
    Runtime("dbos", "dbos", "-", "dbos_tree.py"),
)
#: The SQL that counts the writers' answers a runtime holds durably (read after a kill).
#: A durable answer: a paid call's row (a successor's replays of it are not counted again).
#: orgchart's durable answers: its paid calls on record, and the replies its recorder
#: journaled on arrival whose charge had not committed (the next delivery adopts them:
#: runtime/store/call_replies.py).
DURABLE = {"orgchart": """
    SELECT (SELECT count(*) FROM model_calls WHERE NOT replayed)
         + (SELECT count(*) FROM call_replies r
            WHERE NOT EXISTS (
                SELECT 1 FROM model_calls m
                WHERE m.task_id = r.task_id AND NOT m.replayed
                  AND m.attempt = CAST(r.reply->>'attempt' AS int)
                  AND m.call_index = CAST(r.reply->>'call_index' AS int)
                  AND m.call_try = CAST(r.reply->>'call_try' AS int)
                  AND m.attempt_kind = r.reply->>'attempt_kind'
                  AND m.phase = r.reply->>'phase'))"""}


def installed(runtime: str) -> bool:
    """Whether ``runtime``'s packages import here."""
    names = {"orgchart": (), "langgraph": ("langgraph", "langgraph.checkpoint.postgres"),
             "dbos": ("dbos",)}[runtime]
    try:
        for name in names:
            __import__(name)
    except ImportError:
        return False
    return True


class Process:
    """One runtime's process: an ``orgchart worker`` or a :mod:`bench.peers.child`."""

    def __init__(self, rt: Runtime, url: str, model_url: str, client: str, shape: Shape,
                 resume: bool = False) -> None:
        self.rt, self.url, self.shape, self.resume = rt, url, shape, resume
        self.lines: list[str] = []
        self.root: str | None = None
        self.result: dict[str, Any] | None = None
        # finished() polls on one connection: a connection per poll (every 20 ms) cost the
        # server 2 to 6 ms of CPU each, counted in the runtime's pg_cpu_ms_per_call.
        self._poll: psycopg.Connection[Any] | None = None
        if rt.runtime == "orgchart":
            env = worker_env(url)
            env.update({"ORGCHART_LLM__BACKEND": "ollama", "ORGCHART_OLLAMA__URL": model_url,
                        "ORGCHART_OLLAMA__MAX_PARALLEL": "2000",
                        "ORGCHART_OLLAMA__CLOUD_MAX_PARALLEL": "2000",
                        # PEERS_RECORDER=false: replies read in the worker (a comparison)
                        "ORGCHART_OLLAMA__RECORDER": os.environ.get("PEERS_RECORDER", "true"),
                        # a chain level is a task one level deeper ([policies] max_depth: 5)
                        "ORGCHART_POLICIES__MAX_DEPTH": str(min(shape.depth + 1, 100))})
            self.proc = subprocess.Popen(
                [sys.executable, "-c", WORKER_BOOT, "worker", "--agents",
                 "pe_planner,pe_lead,pe_writer,pe_link,judge",
                 "--agents-module", "bench.peers.orgchart_tree"],
                env=env, cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, start_new_session=True)  # its group: the worker and its recorder
            return
        cmd = [sys.executable, "-m", "bench.peers.child", rt.runtime, rt.option,
               "--db", urls.libpq_url(url), "--model", model_url, "--client", client,
               "--kind", shape.kind, "--leads", str(shape.leads), "--writers",
               str(shape.writers), "--depth", str(shape.depth)] + (["--resume"] if resume else [])
        self.proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("ready"):
                self.ready.set()
            elif line.startswith("done "):
                self.result = json.loads(line[5:])

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_ready(self) -> None:
        """Until the runtime is set up (the worker serves; the child says ``ready``)."""
        if self.rt.runtime == "orgchart":
            wait_serving(self.proc, self.lines, 60)
            time.sleep(1.0)  # its LISTEN connection and first poll
        elif not self.ready.wait(120):
            self.kill()
            raise RuntimeError(f"{self.rt.label} did not start:\n" + "".join(self.lines[-20:]))

    def go(self) -> None:
        """Start the work (or, for a restarted peer, its resumption)."""
        if self.rt.runtime != "orgchart":
            assert self.proc.stdin is not None
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        elif not self.resume:
            store = open_store(self.url)
            try:
                self.root = str(store.tasks.submit(orgchart_tree.root_task(self.shape))[0]["id"])
            finally:
                store.dispose()

    def finished(self, root: str | None) -> bool:
        """Whether the work's root has its answer (raises if the process died)."""
        if self.rt.runtime == "orgchart":
            if self._poll is None:
                self._poll = connect(self.url)
            row = self._poll.execute("SELECT status FROM tasks WHERE id = %s",
                                     (root,)).fetchone()
            if row is not None and row[0] in TERMINAL and row[0] != "done":
                raise RuntimeError(f"orgchart's root ended {row[0]}:\n" + "".join(self.lines[-30:]))
            return row is not None and row[0] == "done"
        if self.result is None and self.proc.poll() is not None:
            time.sleep(0.2)  # the reader thread's last line
            if self.result is None:
                raise RuntimeError(f"{self.rt.label} exited:\n" + "".join(self.lines[-30:]))
        return self.result is not None

    def close_poll(self) -> None:
        """Close the connection :meth:`finished` polls on (if it opened one)."""
        if self._poll is not None:
            self._poll.close()
            self._poll = None

    def kill(self, group: bool = False) -> None:
        """SIGKILL it (``group``: with the processes it started, orgchart's recorder)."""
        self.close_poll()
        if group and self.rt.runtime == "orgchart":
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """Let it end (a peer ends by itself; the worker is asked to), SIGKILL past 30 s."""
        self.close_poll()
        if self.rt.runtime == "orgchart":
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()


def _tree_kb(pid: int, field: str) -> int:
    """``field`` (VmRSS, VmHWM) of ``pid`` and of its live children, added up."""
    return sum(_vm_kb(p, field) or 0 for p in (pid, *child_pids(pid)))


def _counters(url: str) -> tuple[int, float | None, dict[str, int]]:
    """The server's WAL position (bytes), its CPU seconds and this database's rows so far."""
    with connect(url) as conn:
        lsn = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint"
                           ).fetchone()[0]  # type: ignore[index]
    return int(lsn), server_cpu_seconds(url), _table_rows(url)


def _table_rows(url: str) -> dict[str, int]:
    """Rows written so far into each table of this database (``pg_stat_user_tables``).

    Inserted, updated and deleted rows; the catalogs' (the set-up's DDL) are not counted.
    """
    with connect(url) as conn:
        return {f"{schema}.{name}": int(n) for schema, name, n in conn.execute(
            "SELECT schemaname, relname, n_tup_ins + n_tup_upd + n_tup_del "
            "FROM pg_stat_user_tables")}


_Counts = tuple[int, int, int, int, int]


def _index_counters(url: str) -> dict[str, _Counts]:
    """Per table: rows inserted, updated, updated HOT, its indexes and their bytes."""
    with connect(url) as conn:
        return {f"{schema}.{name}": (int(ins), int(upd), int(hot), int(indexes), int(size))
                for schema, name, ins, upd, hot, indexes, size in conn.execute(
                    "SELECT s.schemaname, s.relname, s.n_tup_ins, s.n_tup_upd, s.n_tup_hot_upd, "
                    "       (SELECT count(*) FROM pg_index i WHERE i.indrelid = s.relid), "
                    "       pg_indexes_size(s.relid) "
                    "FROM pg_stat_user_tables s")}


def index_writes(before: dict[str, _Counts], after: dict[str, _Counts],
                 calls: int) -> dict[str, Any]:
    """Where a call's database work goes, by table: its index writes per call.

    ``index_bytes_per_call``: how much its indexes grew per call (measured).
    ``index_entries_per_call_at_most``: an insert or an update that is not HOT (it changed
    an indexed column, or its page had no room) adds an entry to each index whose
    predicate the new row meets; a HOT update adds none. So at most
    ``(inserts + updates - HOT updates) x indexes`` per call (a partial index the row
    leaves gets none). ``hot_update_share``: the share of its updates that were HOT.
    """
    out: dict[str, Any] = {}
    for name, (ins, upd, hot, indexes, size) in after.items():
        ins0, upd0, hot0, _, size0 = before.get(name, (0, 0, 0, indexes, 0))
        ins, upd, hot = ins - ins0, upd - upd0, hot - hot0
        if ins or upd:
            out[name] = {"indexes": indexes,
                         "index_bytes_per_call": round((size - size0) / calls),
                         "index_entries_per_call_at_most": round(
                             (ins + upd - hot) * indexes / calls, 1),
                         "hot_update_share": round(hot / upd, 2) if upd else None}
    return dict(sorted(out.items(), key=lambda item: -item[1]["index_bytes_per_call"]))


def _timeline(url: str) -> list[str]:
    """orgchart's transitions, first and last, from the submit (``bench.makespan``'s)."""
    store = open_store(url)
    try:
        with store.engine.connect() as conn:
            return makespan_timeline(conn)
    finally:
        store.dispose()


def _durable(rt: Runtime, url: str) -> int:
    if rt.runtime == "orgchart":
        sql = DURABLE["orgchart"]
    elif rt.runtime == "langgraph":
        from bench.peers.langgraph_tree import DURABLE_ANSWERS as sql
    else:
        from bench.peers.dbos_tree import DURABLE_ANSWERS as sql
    with connect(url) as conn:
        return int(conn.execute(sql).fetchone()[0])  # type: ignore[index]


#: An answer the server sent this long before the SIGKILL must have been durable (issue 44).
LOST_MARGIN_SECONDS = 0.020


def lost_answers(ends: list[float], killed: float, durable: int,
                 margin: float = LOST_MARGIN_SECONDS) -> tuple[int, float]:
    """Answers sent ``margin`` s or more before the kill, and the share of them not durable.

    ``ends``: when the server sent each answer (its clock, this machine's); ``durable``:
    the runtime's durable answers, read after the kill. Which answers are durable is not
    known one by one, only their number: those sent in the last ``margin`` s may account
    for some of it, so the share is an upper bound (every one of them counted durable).
    """
    before = sum(1 for at in ends if at <= killed - margin)
    late = sum(1 for at in ends if killed - margin < at <= killed)
    durable_of_before = min(before, max(0, durable - late))
    return before, (round(1 - durable_of_before / before, 4) if before else 0.0)


def _crash(proc: Process, rt: Runtime, url: str, model_url: str, client: str,
           shape: Shape, group: bool = False) -> tuple[Process, dict[str, Any]]:
    """SIGKILL ``proc`` (``group``: with its recorder); read what was durable; restart.

    Durable answers are read at once after the kill, and again when the successor starts
    (what it finds on record: a peer's count cannot change once it is dead; orgchart's
    recorder, when it lives on, records the answers that arrived).
    """
    at_kill = _get(model_url + "/stats")
    killed_wall = time.time()
    proc.kill(group)
    killed_at = time.monotonic()
    durable = _durable(rt, url)
    ends = sorted(_get(model_url + "/starts")["ends"])
    before, lost = lost_answers(ends, killed_wall, durable)
    half = ends[len(ends) // 2] if ends else killed_wall
    successor = Process(rt, url, model_url, client, shape, resume=True)
    successor.root = proc.root
    successor.wait_ready()
    durable_at_restart = _durable(rt, url)
    successor.go()
    return successor, {
        "answered_at_kill": at_kill["answered"],
        "durable_at_kill": durable,
        "sent_20ms_before_kill": before,
        "lost_answers_at_kill": lost,
        "durable_at_restart": durable_at_restart,
        "lost_answers_at_restart": lost_answers(ends, killed_wall, durable_at_restart)[1],
        # how long before the kill the median answer so far had left the server
        "kill_after_half_ms": round((killed_wall - half) * 1000, 1),
        # sent and not yet durably recorded: answered but not recorded, or not answered
        "in_flight_at_kill": at_kill["answered"] - durable + at_kill["in_flight"],
        "restart_seconds": round(time.monotonic() - killed_at, 3),
    }


def run_once(rt: Runtime, client: str, shape: Shape, delay: float, server: str | None,
             crash: bool = False, group: bool = False) -> dict[str, Any]:
    """One run of ``shape`` on ``rt``; its figures (see the module's docstring)."""
    with scratch_database("peers", server) as url:
        model_proc, model_url = start_model_server(delay)
        proc = Process(rt, url, model_url, client, shape)
        try:
            proc.wait_ready()
            time.sleep(1.5)  # the set-up's statistics reach pg_stat_database
            wal0, pg_cpu0, tables0 = _counters(url)
            indexes0 = _index_counters(url)
            idle_kb, cpu0 = _tree_kb(proc.proc.pid, "VmRSS"), tree_cpu_seconds(proc.proc.pid)
            _get(model_url + "/stats/reset")
            started = time.monotonic()
            proc.go()
            root, crashed = proc.root, None
            while not proc.finished(root):
                if time.monotonic() - started > RUN_TIMEOUT:
                    raise RuntimeError(f"{rt.label}: no answer in {RUN_TIMEOUT} s")
                if crash and crashed is None and \
                        _get(model_url + "/stats")["answered"] >= shape.leads * shape.writers // 2:
                    proc, crashed = _crash(proc, rt, url, model_url, client, shape, group)
                # Watching for the kill: often, so it comes near the half, not past it.
                time.sleep(0.002 if crash and crashed is None else 0.02)
            makespan = time.monotonic() - started
            wal1, pg_cpu1, _ = _counters(url)
            peak_kb = _tree_kb(proc.proc.pid, "VmHWM")
            cpu = tree_cpu_seconds(proc.proc.pid) - cpu0
            counts = _get(model_url + "/stats")
            timeline = _timeline(url) if rt.runtime == "orgchart" else None
            proc.stop()
        finally:
            if proc.proc.poll() is None:
                proc.kill(group=True)
            model_proc.kill()
            model_proc.wait()
        time.sleep(1.0)  # the last backends' statistics
        tables = {name: n - tables0.get(name, 0) for name, n in _counters(url)[2].items()}
        indexes1 = _index_counters(url)
    if proc.result is not None:  # a peer measures itself (it may end before it is read)
        makespan = proc.result["seconds"] if crashed is None else makespan
        cpu, peak_kb = proc.result["cpu_seconds"], proc.result["peak_rss_kb"]
    calls = counts["answered"] + counts["aborted"]
    if calls < shape.calls:
        raise RuntimeError(f"{rt.label}: {calls} model calls, the work makes {shape.calls}")
    figures: dict[str, Any] = {
        "makespan_seconds": round(makespan, 3), "model_calls": calls,
        "peak_calls_in_flight": counts["peak"],
        "rows_per_call": round(sum(tables.values()) / calls, 2),
        "rows_per_call_by_table": {name: round(n / calls, 2) for name, n in sorted(
            tables.items(), key=lambda item: -item[1]) if n},
        **({"timeline_seconds": timeline} if timeline else {}),
        "wal_bytes_per_call": round((wal1 - wal0) / calls),
        "index_writes_by_table": index_writes(indexes0, indexes1, calls),
        "pg_cpu_ms_per_call": (round((pg_cpu1 - pg_cpu0) / calls * 1000, 3)
                               if pg_cpu0 is not None and pg_cpu1 is not None else None),
    }
    if crashed is not None:
        return {"crash_makespan_seconds": figures["makespan_seconds"],
                "crash_model_calls": calls, "repaid_calls": calls - shape.calls, **crashed}
    figures.update({"client_cpu_ms_per_call": round(cpu / calls * 1000, 3),
                    "peak_rss_mb": round(peak_kb / 1024, 1),
                    "rss_per_call_in_flight_kb": round((peak_kb - idle_kb) / counts["peak"], 1)})
    return figures


def measure(runtimes: tuple[Runtime, ...], tree: Shape, delay: float, chain: Shape,
            chain_delay: float, server: str | None, crash: bool) -> dict[str, dict[str, Any]]:
    """Every figure of every runtime: ``{label: {figure: value}}``."""
    out: dict[str, dict[str, Any]] = {}
    for rt in runtimes:
        figures: dict[str, Any] = {"durability": rt.option,
                                   "code_lines": code_lines(PEERS_DIR / rt.module)}
        for client in ("shared", "ollama"):
            run = run_once(rt, client, tree, delay, server)
            run["vs_critical_path"] = round(run["makespan_seconds"] / (2 * delay), 3)
            figures.update({f"{client}_{key}": value for key, value in run.items()})
        if crash:
            figures.update(run_once(rt, "shared", tree, delay, server, crash=True))
            if rt.runtime == "orgchart":  # the worker and its recorder killed together
                figures.update({f"crash_group_{key}": value for key, value in run_once(
                    rt, "shared", tree, delay, server, crash=True, group=True).items()})
        run = run_once(rt, "shared", chain, chain_delay, server)
        figures["chain_makespan_seconds"] = run["makespan_seconds"]
        figures["chain_overhead_ms_per_level"] = round(
            (run["makespan_seconds"] - chain.depth * chain_delay) / chain.depth * 1000, 2)
        out[rt.label] = figures
        print(f"  {rt.label}: {figures}", file=sys.stderr, flush=True)
    return out


def goals(runs: dict[str, dict[str, Any]], floor_seconds: float | None) -> dict[str, Any]:
    """The issue's measures, orgchart against the best peer (shared-transport runs)."""
    ours = runs.get("orgchart")
    peers = {label: f for label, f in runs.items() if label != "orgchart"}
    if ours is None:
        return {}
    out: dict[str, Any] = {}
    if floor_seconds is not None:
        out["engine_overhead_seconds"] = round(ours["shared_makespan_seconds"] - floor_seconds, 3)
        out["makespan_floor_bare_seconds"] = floor_seconds
    if not peers:
        return out
    out["peer_makespan_ratio"] = round(ours["shared_makespan_seconds"] / min(
        f["shared_makespan_seconds"] for f in peers.values()), 3)
    for key, name in (("repaid_calls", "peer_repaid_calls"),
                      ("lost_answers_at_kill", "lost_answers_at_kill"),
                      ("lost_answers_at_restart", "lost_answers_at_restart"),
                      ("crash_group_lost_answers_at_kill", "lost_answers_group_kill"),
                      ("crash_group_repaid_calls", "repaid_calls_group_kill"),
                      ("crash_makespan_seconds", "crash_makespan_seconds"),
                      ("shared_pg_cpu_ms_per_call", "peer_pg_cpu_ms_per_call"),
                      ("shared_wal_bytes_per_call", "peer_wal_bytes_per_call"),
                      ("chain_overhead_ms_per_level", "chain_overhead_ms_per_level")):
        if key in ours:
            out[name] = {label: f.get(key) for label, f in runs.items()}
    return out


COLUMNS = (("makespan s", "shared_makespan_seconds"), ("x crit", "shared_vs_critical_path"),
           ("peak", "shared_peak_calls_in_flight"), ("rows/call", "shared_rows_per_call"),
           ("WAL B/call", "shared_wal_bytes_per_call"), ("pg ms/call", "shared_pg_cpu_ms_per_call"),
           ("cpu ms/call", "shared_client_cpu_ms_per_call"), ("RSS MB", "shared_peak_rss_mb"),
           ("ollama s", "ollama_makespan_seconds"), ("repaid", "repaid_calls"),
           ("durable", "durable_at_kill"), ("in flight", "in_flight_at_kill"),
           ("sent-20ms", "sent_20ms_before_kill"), ("lost", "lost_answers_at_kill"),
           ("lost@restart", "lost_answers_at_restart"),
           ("group lost", "crash_group_lost_answers_at_kill"),
           ("group repaid", "crash_group_repaid_calls"),
           ("crash s", "crash_makespan_seconds"), ("chain ms/lvl", "chain_overhead_ms_per_level"),
           ("lines", "code_lines"))


def table(runs: dict[str, dict[str, Any]]) -> str:
    """One row per runtime, one column per figure."""
    rows = [["runtime"] + [title for title, _ in COLUMNS]]
    rows += [[label] + [str(f.get(key, "-")) for _, key in COLUMNS] for label, f in runs.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
                     for row in rows)
