"""What every benchmark shares: a scratch database, worker processes, statistics, output.

Each benchmark runs against the server named by ``ORGCHART_DATABASE_URL`` (else the
embedded server, as ``runtime.store.postgres.urls.resolve_url`` decides), in a database of its own
(``bench_<name>_<random>``, migrated to head) that it drops at the end, so a run never
touches real data and two runs never see each other's rows.
"""

from __future__ import annotations

import atexit
import compileall
import functools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from runtime.store.postgres import engines, migrations, urls
from runtime.store.store import Store

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: The chunk size for bulk submission (one ``submit_many`` statement each).
SUBMIT_CHUNK = 5_000


# ---------------------------------------------------------------------- databases
def server_url() -> str:
    """The server to measure: ``ORGCHART_DATABASE_URL``, else the embedded PostgreSQL."""
    return urls.resolve_url()


def with_database(url: str, name: str) -> str:
    """``url`` pointing at database ``name`` on the same server."""
    return sa.engine.make_url(urls.sqlalchemy_url(url)).set(database=name).render_as_string(
        hide_password=False)


def admin(url: str, *statements: str) -> None:
    """Run statements in autocommit (CREATE/DROP DATABASE)."""
    with psycopg.connect(urls.libpq_url(url), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


@contextmanager
def scratch_database(name: str, server: str | None = None) -> Iterator[str]:
    """Create ``bench_<name>_<random>`` on ``server``, migrate it, yield its URL, drop it."""
    server = server or server_url()
    dbname = f"bench_{name}_{uuid.uuid4().hex[:8]}"
    admin(server, f'CREATE DATABASE "{dbname}"')
    url = with_database(server, dbname)
    try:
        migrations.upgrade(url)
        yield url
    finally:
        admin(server, f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def open_store(url: str, pool_size: int = 4) -> Store:
    """A Store on ``url``."""
    return Store(engines.create_db_engine(url, pool_size=pool_size))


def connect(url: str, autocommit: bool = True) -> psycopg.Connection[Any]:
    """A raw psycopg connection (the reference loops and hand-made data)."""
    return psycopg.connect(urls.libpq_url(url), autocommit=autocommit)


def truncate_tasks(url: str) -> None:
    """Empty the task tables (between trials in one scratch database)."""
    admin(url, "TRUNCATE tasks, task_events CASCADE")


def submit_noop(store: Store, n: int, agent: str = "noop") -> int:
    """Bulk-insert ``n`` root tasks for ``agent`` with ``store.tasks.submit_many``."""
    inserted = 0
    while inserted < n:
        size = min(SUBMIT_CHUNK, n - inserted)
        inserted += store.tasks.submit_many(agent, "work", [{"goal": f"bench {inserted + i}"}
                                                            for i in range(size)])
    return inserted


def machine(url: str) -> dict[str, Any]:
    """The machine and server a run measured: cores, PostgreSQL, Python."""
    with connect(url) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        full = conn.execute("SELECT version()").fetchone()[0]  # type: ignore[index]
    parsed = sa.engine.make_url(urls.sqlalchemy_url(url))
    embedded = os.environ.get("ORGCHART_DATABASE_URL") is None and \
        os.environ.get("DATABASE_URL") is None
    return {
        "nproc": os.cpu_count(),
        "postgresql": version,
        "postgresql_full": full,
        "server": "embedded" if embedded else f"{parsed.host or 'socket'}:{parsed.port or ''}",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


# ---------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    """The median."""
    return float(statistics.median(values))


def ms(seconds: float) -> float:
    """Seconds to milliseconds, rounded for reports."""
    return round(seconds * 1000.0, 3)


# ---------------------------------------------------------------------- workers
@functools.cache
def _scratch_home() -> Path:
    """A temporary ORGCHART_HOME with an empty config file, removed at exit."""
    home = Path(tempfile.mkdtemp(prefix="orgchart-bench-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    (home / "empty.toml").write_text("")
    return home


def worker_env(url: str) -> dict[str, str]:
    """Environment for ``orgchart worker`` processes on ``url``: offline model, no config file."""
    home = _scratch_home()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORGCHART_")}
    path = env.get("PYTHONPATH")
    env.update({
        "ORGCHART_DATABASE_URL": url,
        "ORGCHART_LLM__BACKEND": "offline",
        "ORGCHART_CONFIG": str(home / "empty.toml"),
        "ORGCHART_HOME": str(home),
        "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else ""),
    })
    return env


def worker_command(agents: str, *, batch_size: int | None = None,
                   sync_threads: int | None = None, once: bool = False,
                   agents_module: str = "tests.support_agents") -> list[str]:
    """The ``orgchart worker`` command line, run by this interpreter."""
    cmd = [sys.executable, "-c", "from runtime.cli.app import main; main()", "worker",
           "--agents", agents, "--agents-module", agents_module]
    if batch_size is not None:
        cmd += ["--batch-size", str(batch_size)]
    if sync_threads is not None:
        cmd += ["--sync-threads", str(sync_threads)]
    if once:
        cmd.append("--once")
    return cmd


def compile_sources() -> None:
    """Write the bytecode of our packages (and bench's) before a clock starts.

    A deployed worker starts from bytecode; a machine that sets
    ``PYTHONDONTWRITEBYTECODE`` (ours do) never writes it, and every process a benchmark
    starts would compile about a hundred modules again: 0.1 to 0.2 s of start-up on the
    two-core bench machine that no deployment pays. Both sides of a comparison run from
    bytecode (pgqueuer's is written when pip installs it).
    """
    for package in ("agents", "runtime", "policies", "bench"):
        compileall.compile_dir(str(REPO_ROOT / package), quiet=1)
    compileall.compile_dir(str(REPO_ROOT / "tests"), maxlevels=0, quiet=1)  # support_agents


def spawn_worker(url: str, cmd: list[str]) -> subprocess.Popen[bytes]:
    """Start one worker process (its output kept for error reports)."""
    return subprocess.Popen(cmd, env=worker_env(url), cwd=str(REPO_ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def stop_worker(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> str:
    """SIGTERM a worker, wait for it, and return its stderr (SIGKILL past ``timeout``)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
    return stderr.decode(errors="replace")


def proc_cpu_seconds(pid: int, with_children: bool = True) -> float:
    """CPU seconds a live process used (plus its reaped children's); 0.0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0.0
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if with_children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The live children of ``pid`` (a worker's: its model-call recorder process)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and of its live children (a worker with its recorder)."""
    return proc_cpu_seconds(pid) + sum(proc_cpu_seconds(c) for c in child_pids(pid))


def server_cpu_seconds(url: str) -> float | None:
    """CPU seconds used so far by the PostgreSQL server at ``url``, if it runs on this machine.

    The postmaster's own time and that of the backends it has reaped, plus its live
    children's: sample before and after a run for the server's share of the work. None
    when the server's data directory or processes cannot be read (a remote server).
    """
    try:
        with connect(url) as conn:
            datadir = conn.execute("SHOW data_directory").fetchone()[0]  # type: ignore[index]
        postmaster = int(Path(datadir, "postmaster.pid").read_text().split()[0])
    except (psycopg.Error, OSError, ValueError, IndexError):
        return None
    total = proc_cpu_seconds(postmaster)
    if total == 0.0 and not Path(f"/proc/{postmaster}").exists():
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == postmaster:
            total += proc_cpu_seconds(int(entry.name))
    return total


def children_cpu_seconds() -> float:
    """CPU seconds used by this process's reaped children (the worker processes)."""
    t = os.times()
    return t.children_user + t.children_system


def peak_rss_mb(pid: int) -> float | None:
    """A live process's peak resident memory (``VmHWM``) in MiB, or None once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


# ---------------------------------------------------------------------- output
def report(name: str, figures: dict[str, Any]) -> dict[str, Any]:
    """Print a benchmark's figures, one per line, and return them."""
    print(f"== {name}", flush=True)
    for key, value in figures.items():
        text = value if isinstance(value, str) and "\n" not in value else json.dumps(value)
        if isinstance(value, str) and "\n" in value:
            text = "\n    " + value.replace("\n", "\n    ")
        print(f"  {key}: {text}", flush=True)
    return figures


def wait_serving(proc: subprocess.Popen[str], lines: list[str], timeout: float) -> None:
    """Read ``proc``'s stderr into ``lines`` (in a thread) until it says "serving".

    Raises RuntimeError with its last lines (after killing it) if it does not within
    ``timeout`` seconds.
    """
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout):
        proc.kill()
        raise RuntimeError("the worker did not start:\n" + "".join(lines[-20:]))
