"""The last orgchart process using an embedded PostgreSQL stops it, however it is stopped.

Real ``orgchart worker`` and ``orgchart serve`` processes on a temporary
``ORGCHART_HOME`` (no database URL: the embedded default), stopped as a process manager
stops them (SIGTERM) or as a person does (SIGINT); afterwards no ``postgres`` process
may be left running on that ``pgdata``. A process that died unannounced (SIGKILL) must
not keep the server running for the one that leaves after it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.helpers import REPO_ROOT, wait_until

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("ORGCHART_TEST_DATABASE_URL")),
    reason="runs once, on the embedded pass",
)

START_TIMEOUT = 90.0
STOP_TIMEOUT = 30.0
WORKER_READY = "serving"  # ``worker <id> serving <agents>``, once the database is up
SERVE_READY = "Application startup complete"


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    """One ORGCHART_HOME for the module (initdb once); every test leaves it stopped."""
    root = Path(tempfile.mkdtemp(prefix="orgchart-test-"))
    os.chmod(root, 0o755)  # the server runs as its own system user when tests run as root
    yield root / "home"
    for pid in postgres_pids(root / "home" / "pgdata"):  # only if a test failed
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def env(home: Path, tmp_path: Path) -> dict[str, str]:
    """The environment of a new user: no database URL, offline models, no config file."""
    names = ("DATABASE_URL", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ORGCHART_") and k not in names}
    (tmp_path / "none.toml").write_text("")
    env.update({"ORGCHART_HOME": str(home), "ORGCHART_LLM__BACKEND": "offline",
                "ORGCHART_CONFIG": str(tmp_path / "none.toml"),
                "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"})
    return env


def postgres_pids(pgdata: Path) -> list[int]:
    """The ``postgres`` processes whose command line names ``pgdata``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if argv and argv[0].endswith(b"postgres") and str(pgdata).encode() in argv:
            pids.append(int(entry.name))
    return pids


class Command:
    """An ``orgchart`` subprocess whose output goes to a file read while it runs."""

    def __init__(self, env: dict[str, str], log: Path, *args: str) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", *args],
                                         env=env, stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        """What it printed so far."""
        return self.log.read_text(errors="replace")

    def wait_for(self, line: str) -> None:
        """Wait until it printed ``line``; fail with its output if it exited first."""
        def printed() -> bool:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.output()}"
            return line in self.output()

        wait_until(printed, START_TIMEOUT, f"{line!r} in the output of {self.proc.args!r}")

    def stop(self, signum: int) -> int | None:
        """Send ``signum`` and wait for the exit; its return code."""
        self.proc.send_signal(signum)
        try:
            return self.proc.wait(STOP_TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def assert_no_server_left(home: Path, *commands: Command) -> None:
    """No postgres runs on ``home``'s pgdata (given a moment: pg_ctl waits for it)."""
    pgdata = home / "pgdata"
    try:
        wait_until(lambda: not postgres_pids(pgdata), STOP_TIMEOUT, "the server to stop")
    except AssertionError:
        logs = "\n".join(c.output() for c in commands)
        raise AssertionError(f"postgres still running on {pgdata}: "
                             f"{postgres_pids(pgdata)}\n{logs}") from None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_stopped_worker_leaves_no_embedded_server(
        home: Path, env: dict[str, str], tmp_path: Path, signum: int) -> None:
    worker = Command(env, tmp_path / "worker.log", "worker")
    worker.wait_for(WORKER_READY)
    assert postgres_pids(home / "pgdata")
    worker.stop(signum)
    assert_no_server_left(home, worker)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_stopped_serve_leaves_no_embedded_server(
        home: Path, env: dict[str, str], tmp_path: Path, signum: int) -> None:
    serve = Command(env, tmp_path / "serve.log", "serve", "--port", "0")
    serve.wait_for(SERVE_READY)
    assert postgres_pids(home / "pgdata")
    serve.stop(signum)
    assert_no_server_left(home, serve)


def test_the_last_process_stops_the_server_after_one_was_sigkilled(
        home: Path, env: dict[str, str], tmp_path: Path) -> None:
    serve = Command(env, tmp_path / "serve.log", "serve", "--port", "0")
    serve.wait_for(SERVE_READY)
    worker = Command(env, tmp_path / "worker.log", "worker")
    worker.wait_for(WORKER_READY)
    serve.stop(signal.SIGKILL)  # dies without leaving: still in the server's list of users
    assert postgres_pids(home / "pgdata"), "the worker still uses the server"
    worker.stop(signal.SIGTERM)
    assert_no_server_left(home, serve, worker)
