"""Helpers for tests that really crash things: worker processes, server faults, invariants.

- :class:`Fleet` starts real ``orgchart worker`` processes (``python -m runtime.cli``),
  SIGKILLs or SIGTERMs them, and kills whatever is left when it is closed.
- :class:`ServerControl` restarts the PostgreSQL server the tests use: the session's
  embedded server (``pg_ctl`` as its system user) or the system PostgreSQL
  (``pg_ctlcluster``); :func:`terminate_backends` kills every session on a database.
- The invariant queries (:func:`duplicate_children`, :func:`spend_mismatches`, ...) read
  the final state; the tests assert on what they return and print it.
- Every fault lands in the test's history (:class:`runtime.audit.history.Recorder`: a
  SIGKILL, a restart, sessions cut), and :func:`assert_audited` runs ``orgchart audit``'s
  checker on the database and that history at the test's end (issue 40).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from runtime.audit.checker import audit
from runtime.audit.history import Recorder, load
from runtime.audit.report import Report
from runtime.store.postgres import embedded, urls
from runtime.store.store import Store
from tests.support import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
TERMINAL = ("done", "failed", "escalated")
#: How long a process gets to exit after SIGKILL or SIGTERM before we stop waiting.
EXIT_WAIT_SECONDS = 10.0


# ---------------------------------------------------------------------- the CLI
def cli_env(orgchart_env: Mapping[str, str], **extra: str) -> dict[str, str]:
    """The ``orgchart_env`` fixture's environment plus the repository on ``PYTHONPATH``."""
    env = dict(orgchart_env)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def cli(*args: str) -> list[str]:
    """The command line of ``orgchart ARGS`` run by this interpreter."""
    return [sys.executable, "-m", "runtime.cli", *args]


def submit_goals(env: Mapping[str, str], goals: Iterable[tuple[str, str, dict[str, Any]]],
                 modules: Iterable[str] = (), timeout: float = 60.0) -> list[dict[str, Any]]:
    """Run one ``orgchart submit --json`` process per ``(goal, agent, payload)``, at once.

    Returns the printed tasks in order; a failed submit raises with its stderr.
    """
    module_args = [a for m in modules for a in ("--agents-module", m)]
    procs = [
        subprocess.Popen(
            cli("submit", goal, "--agent", agent, "--payload", json.dumps(payload),
                *module_args, "--json"),
            env=dict(env), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        for goal, agent, payload in goals
    ]
    tasks = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise AssertionError(f"orgchart submit exited {proc.returncode}: {err}")
            tasks.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(EXIT_WAIT_SECONDS)
    return tasks


# ---------------------------------------------------------------------- workers
@dataclass
class WorkerProc:
    """One ``orgchart worker`` process and what we did to it."""

    number: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    killed_at: float | None = None
    signalled: str | None = None

    @property
    def pid(self) -> int:
        """The process id (it appears in the worker id: ``host:pid:random``)."""
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def log(self, tail: int = 4000) -> str:
        """The end of what the process wrote on stdout and stderr."""
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""


class Fleet:
    """Real worker processes for one test; closing it kills every one still running."""

    def __init__(self, env: Mapping[str, str], log_dir: Path, args: Iterable[str],
                 recorder: Recorder | None = None) -> None:
        self.env = dict(env)
        self.log_dir = log_dir
        self.args = list(args)
        self.recorder = recorder  # SIGKILLs are faults of the test's history
        self.workers: list[WorkerProc] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, *extra: str, new_session: bool = False) -> WorkerProc:
        """Start one ``orgchart worker`` with the fleet's arguments (plus ``extra``).

        ``new_session``: in a process group of its own (with the processes it starts, its
        model-call recorder), so that :meth:`sigkill` can kill them together.
        """
        number = len(self.workers)
        log_path = self.log_dir / f"worker-{number}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cli("worker", *self.args, *extra), env=self.env,
                                    cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=new_session)
        worker = WorkerProc(number, proc, log_path)
        self.workers.append(worker)
        return worker

    def sigkill(self, worker: WorkerProc, group: bool = False) -> None:
        """SIGKILL one worker and reap it: no goodbye, its leases stay behind.

        ``group``: its whole process group (started with ``new_session``), its recorder
        process with it.
        """
        worker.signalled = "SIGKILL"
        worker.killed_at = time.monotonic()
        if group:
            os.killpg(worker.proc.pid, signal.SIGKILL)
        else:
            worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(EXIT_WAIT_SECONDS)
        if self.recorder is not None:
            self.recorder.fault("kill", f"worker pid {worker.pid}")

    def sigterm(self, worker: WorkerProc, timeout: float = 30.0) -> int | None:
        """SIGTERM one worker and wait for it; return its exit status (None if it hung)."""
        worker.signalled = "SIGTERM"
        worker.proc.send_signal(signal.SIGTERM)
        try:
            return worker.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def alive(self) -> list[WorkerProc]:
        """The workers still running."""
        return [w for w in self.workers if w.alive()]

    def unexpected_exits(self) -> list[WorkerProc]:
        """Workers that ended although nobody signalled them."""
        return [w for w in self.workers if w.signalled is None and not w.alive()]

    def close(self) -> None:
        """SIGKILL every worker still running and wait for each."""
        for worker in self.workers:
            if worker.alive():
                worker.proc.kill()
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(EXIT_WAIT_SECONDS)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- server faults
@dataclass
class ServerControl:
    """Restarts the server behind the test database: embedded (pg_ctl) or system."""

    kind: str  # "embedded" or "system"
    description: str
    _restart: Callable[[float], None]
    recorder: Recorder | None = None  # the restart is a fault of the test's history

    def restart(self, downtime_seconds: float = 0.0) -> float:
        """Stop the server (fast mode: sessions are cut), wait, start it; return seconds taken."""
        started = time.monotonic()
        if self.recorder is None:
            self._restart(downtime_seconds)
        else:
            with self.recorder.faulting("restart", self.description):
                self._restart(downtime_seconds)
        return time.monotonic() - started


def _embedded_restart(server: Any) -> Callable[[float], None]:
    def pg_ctl(binary: Path, args: list[str]) -> None:
        # Output to a file, not a pipe: the postmaster it starts would inherit a pipe.
        command = [str(binary), "-D", str(server.pgdata), *args]
        with tempfile.TemporaryFile("w+") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, text=True,
                                  user=server.system_user, timeout=90, check=False)
            out.seek(0)
            assert done.returncode == 0, f"{command}: {out.read()}"

    def restart(downtime: float) -> None:
        info = server.get_postmaster_info()
        assert info.process is not None, "the embedded server is not running"
        # pg_ctl sits beside the postgres binary (PostgreSQL's bindir): the one the
        # running postmaster was started from.
        binary = Path(info.process.exe()).parent / "pg_ctl"
        pg_ctl(binary, ["-w", "-t", "60", "-m", "fast", "stop"])
        time.sleep(downtime)
        # The same options the package starts it with: unix socket only, same directory.
        pg_ctl(binary, ["-w", "-t", "60", "-o", '-h ""', "-o", f"-k {info.socket_dir}",
                        "-l", str(server.log), "start"])
        # The handle remembers the postmaster it started; its public start finds the new
        # one running and takes it (so the session's cleanup stops this server).
        server.ensure_postgres_running()
        assert server.get_postmaster_info().pid != info.pid, "the handle kept the old server"

    return restart


def _system_restart(cluster: tuple[str, str]) -> Callable[[float], None]:
    version, name = cluster

    def ctl(action: str) -> None:
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, name, action],
                       check=True, capture_output=True, timeout=90)

    def restart(downtime: float) -> None:
        if downtime <= 0:
            ctl("restart")
            return
        ctl("stop")
        time.sleep(downtime)
        ctl("start")

    return restart


def server_control(server_url: str) -> ServerControl | None:
    """How to restart the server at ``server_url``, or None when this machine cannot.

    The session's embedded server is found among the servers this process joined
    (``runtime.store.postgres.embedded.joined_servers``) by its socket directory; a
    server on 127.0.0.1/localhost:5432 is taken to be the system cluster
    (``pg_ctlcluster``, cluster named by ``SHOW cluster_name``).
    """
    url = sa.engine.make_url(urls.sqlalchemy_url(server_url))
    socket_dir = url.query.get("host")
    if isinstance(socket_dir, tuple):
        socket_dir = socket_dir[0]
    if socket_dir and str(socket_dir).startswith("/"):
        for pgdata, server in list(embedded.joined_servers().items()):
            info = server.get_postmaster_info()
            if info.socket_dir is not None and Path(info.socket_dir) == Path(socket_dir):
                return ServerControl("embedded", f"embedded PostgreSQL in {pgdata}",
                                     _embedded_restart(server))
        return None
    if url.host in ("127.0.0.1", "localhost") and (url.port or 5432) == 5432 \
            and shutil.which("pg_ctlcluster") and os.geteuid() == 0:
        with psycopg.connect(urls.libpq_url(server_url), autocommit=True) as conn:
            row = conn.execute("SHOW cluster_name").fetchone()
            version = conn.execute("SHOW server_version_num").fetchone()
        cluster_name = row[0] if row else ""
        if "/" in cluster_name:
            major, name = cluster_name.split("/", 1)
        else:
            major, name = str(int(version[0]) // 10000) if version else "15", "main"
        return ServerControl("system", f"system PostgreSQL cluster {major}/{name}",
                             _system_restart((major, name)))
    return None


def terminate_backends(db_url: str, recorder: Recorder | None = None) -> int:
    """Terminate every other session on ``db_url``'s database; return how many.

    In the history (``recorder``) it is a partition: every session is cut at once.
    """
    started = time.time()
    with psycopg.connect(urls.libpq_url(db_url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchall()
    if recorder is not None:
        recorder.fault("partition", "every session cut", started, time.time())
    return sum(1 for (ok,) in rows if ok)


def record_model_server(recorder: Recorder | None, server: Any) -> int:
    """Copy a fake model server's log of answered requests into the history; how many."""
    if recorder is None:
        return 0
    for key, at in list(server.answer_log):
        recorder.request("model", key, at)
    return len(server.answer_log)


def assert_audited(store: Store, recorder: Recorder | None, roots: Any = None) -> Report:
    """Run the audit's checker on the database and the test's history; fail on a violation.

    Prints what it checked (and the violations, with their evidence, in the failure).
    """
    report = audited(store, recorder, roots)
    assert report.ok, report.text()
    return report


def audited(store: Store, recorder: Recorder | None, roots: Any = None) -> Report:
    """The audit's report on the database and the test's history, printed in short.

    For a test that must dispose of its store before its asserts: assert ``report.ok``
    (with ``report.text()``) there.
    """
    history = load(recorder.path) if recorder else None
    report = audit(store, roots=roots, history=history)
    print(f"  audit: {', '.join(f'{n} {k}' for k, n in sorted(report.checked.items()))}; "
          f"{len(report.in_flight)} allowed as in flight; "
          f"{len(report.violations)} violation(s)")
    # One line for `make torture` (tests/chaos/torture.py) to add up.
    faults = Counter(f.fault for f in history.faults) if history else Counter()
    print("AUDIT_REPORT " + json.dumps({"checked": dict(report.checked),
                                        "violations": len(report.violations),
                                        "in_flight": len(report.in_flight),
                                        "faults": dict(faults)}), flush=True)
    return report


def server_now(store: Store, timeout: float = 30.0) -> Any:
    """The server's clock (retried while the server comes back)."""
    return _server_value(store, "SELECT clock_timestamp()", timeout)


def server_started(store: Store, timeout: float = 30.0) -> Any:
    """When the running server started (retried while it comes back): after a restart,
    the moment the workers could reach it again."""
    return _server_value(store, "SELECT pg_postmaster_start_time()", timeout)


def _server_value(store: Store, sql: str, timeout: float) -> Any:
    def read() -> Any:
        try:
            with store.engine.connect() as conn:
                return conn.execute(sa.text(sql)).scalar()
        except sa.exc.DBAPIError:
            return None

    return wait_until(read, timeout, "the database to answer", interval=0.2)


# ---------------------------------------------------------------------- invariants
def _all(store: Store, sql: str, **params: Any) -> list[Any]:
    with store.engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params).all())


def _dicts(store: Store, sql: str, **params: Any) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(sql), params).mappings()]


def status_counts(store: Store) -> Counter[str]:
    """Tasks per status."""
    return Counter({r.status: int(r.n) for r in _all(
        store, "SELECT status, count(*) AS n FROM tasks GROUP BY status")})


def unfinished(store: Store) -> int:
    """How many tasks are not terminal yet."""
    return sum(n for s, n in status_counts(store).items() if s not in TERMINAL)


def held_by(store: Store, pid: int) -> list[dict[str, Any]]:
    """Tasks whose lease names the worker process ``pid`` (worker ids are host:pid:rand).

    ``held_seconds`` is how long ago this delivery claimed the task (the server's clock).
    """
    return _dicts(
        store, "SELECT id, status, to_agent, phase, lease_owner, "
               "extract(epoch FROM clock_timestamp() - claimed_at)::float AS held_seconds "
               "FROM tasks "
               "WHERE lease_token IS NOT NULL AND lease_owner LIKE :pattern",
        pattern=f"%:{pid}:%")


def held_at_death(store: Store, pid: int) -> list[dict[str, Any]]:
    """What the worker process ``pid`` held when it died, read just after its SIGKILL.

    :func:`held_by`, plus the running tasks a live worker's dead-owner pass already took
    back from it (within a second of the kill, maybe before this read): those are known
    by their release event following a claim of ``pid``'s.
    """
    held = held_by(store, pid)
    known = {t["id"] for t in held}
    return held + [r for r in _dicts(
        store, "SELECT e.task_id AS id, e.from_status AS status, t.to_agent, t.phase, "
               "c.worker AS lease_owner, NULL AS held_seconds "
               "FROM task_events e JOIN tasks t ON t.id = e.task_id "
               "CROSS JOIN LATERAL (SELECT worker FROM task_events c "
               "  WHERE c.task_id = e.task_id AND c.id < e.id AND c.to_status = 'running' "
               "  ORDER BY c.id DESC LIMIT 1) c "
               "WHERE e.worker = 'reaper' AND e.detail LIKE :ended "
               "AND c.worker LIKE :pattern",
        ended=REAPED_DETAILS[1] + "%", pattern=f"%:{pid}:%") if r["id"] not in known]


def duplicate_children(store: Store) -> list[tuple[uuid.UUID, str, int]]:
    """``(parent_id, idempotency_key, copies)`` for every child that exists twice."""
    return [(r.parent_id, r.idempotency_key, int(r.n)) for r in _all(
        store, "SELECT parent_id, idempotency_key, count(*) AS n FROM tasks "
               "WHERE parent_id IS NOT NULL GROUP BY parent_id, idempotency_key "
               "HAVING count(*) > 1")]


def spend_mismatches(store: Store) -> list[dict[str, Any]]:
    """Roots whose ``spent_*`` differs from the sum of ``own_*`` over their tree."""
    return _dicts(store, """
        SELECT r.id, r.spent_tokens, r.spent_usd,
               sum(t.own_tokens) AS tree_tokens, sum(t.own_usd) AS tree_usd
        FROM tasks r JOIN tasks t ON t.root_id = r.id
        WHERE r.parent_id IS NULL
        GROUP BY r.id, r.spent_tokens, r.spent_usd
        HAVING sum(t.own_tokens) <> r.spent_tokens OR sum(t.own_usd) <> r.spent_usd""")


def parent_spend_mismatches(store: Store) -> int:
    """Inner nodes whose ``spent_tokens`` is not own plus their children's ``spent_tokens``."""
    return int(_all(store, """
        SELECT count(*) AS n FROM (
            SELECT p.id FROM tasks p JOIN tasks c ON c.parent_id = p.id
            GROUP BY p.id, p.spent_tokens, p.own_tokens
            HAVING p.own_tokens + sum(c.spent_tokens) <> p.spent_tokens) bad""")[0].n)


def spend_totals(store: Store) -> tuple[int, Any, int]:
    """(tokens spent over all roots, USD spent over all roots, model calls recorded)."""
    row = _all(store, "SELECT COALESCE(sum(spent_tokens), 0) AS tokens, "
                      "COALESCE(sum(spent_usd), 0) AS usd, "
                      "(SELECT count(*) FROM model_calls) AS calls "
                      "FROM tasks WHERE parent_id IS NULL")[0]
    return int(row.tokens), row.usd, int(row.calls)


def events_of(store: Store, task_id: uuid.UUID) -> list[dict[str, Any]]:
    """A task's events, oldest first (from, to, worker, detail)."""
    return _dicts(
        store, "SELECT from_status, to_status, worker, detail, at FROM task_events "
               "WHERE task_id = :id ORDER BY id", id=task_id)


#: How the reaper's releases begin: a lease expired, or the holder's session ended.
REAPED_DETAILS = ("lease expired", "released: its worker's session ended")


def after_reaping(store: Store, task_id: uuid.UUID) -> list[dict[str, Any]]:
    """A task's events after the reaper released it (its lease expired, or its worker's
    session ended: the worker died); fails if never."""
    history = events_of(store, task_id)
    reaped = [i for i, e in enumerate(history)
              if e["worker"] == "reaper" and e["detail"].startswith(REAPED_DETAILS)]
    assert reaped, f"task {task_id} was never reaped: {history}"
    after = history[reaped[0] + 1:]
    assert after, f"nothing happened to task {task_id} after it was reaped: {history}"
    return after


def events_by_pid(store: Store, pid: int, after: Any = None, before: Any = None) -> int:
    """How many transitions the worker process ``pid`` wrote between two server times."""
    return int(_all(store, "SELECT count(*) AS n FROM task_events WHERE worker LIKE :pattern "
                           "AND (CAST(:after AS timestamptz) IS NULL OR at > :after) "
                           "AND (CAST(:before AS timestamptz) IS NULL OR at < :before)",
                    pattern=f"%:{pid}:%", after=after, before=before)[0].n)


def unexplained_failures(store: Store) -> list[tuple[str, str, str | None]]:
    """Failed or escalated tasks whose cause is not the chaos itself.

    Expected under repeated SIGKILLs: ``poison`` (a task whose lease expired
    ``max_delivery`` times) and parents escalating because such a child failed. Anything
    else (an agent error caused by a dropped connection, say) is a runtime bug.
    """
    return [(r.to_agent, r.status, r.error) for r in _all(
        store, "SELECT to_agent, status, error FROM tasks "
               "WHERE (status = 'failed' AND error NOT LIKE 'poison:%') "
               "   OR (status = 'escalated' AND error NOT LIKE '%children did not end done') "
               "ORDER BY completed_at")]


def reaped_count(store: Store) -> int:
    """Transitions written by the reaper (expired leases released or poisoned)."""
    return int(_all(store, "SELECT count(*) AS n FROM task_events "
                           "WHERE worker = 'reaper'")[0].n)
