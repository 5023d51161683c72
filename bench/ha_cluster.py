"""A local pg_auto_failover formation, and worker "hosts" in network namespaces.

Used by the high-availability tests (``tests/ha``), ``bench/ha.py`` and ``make ha-demo``.

- :class:`Formation` starts a monitor and two PostgreSQL 15 nodes with ``pg_autoctl`` as
  the ``postgres`` user (it refuses root), on loopback ports, with synchronous
  replication (pg_auto_failover's default for a primary with one quorum standby). It
  lowers the monitor's health-check settings (:data:`MONITOR_SETTINGS`) so a dead
  primary is replaced in seconds, not 30 to 50. :meth:`Formation.kill_primary`
  SIGKILLs the primary's ``pg_autoctl`` process tree and its postmaster, as losing its
  host would. :meth:`Formation.close` SIGKILLs every process it started (by PID) and
  removes its files, and ``pg_autoctl``'s per-path config and state under the
  ``postgres`` user's home (a formation re-created at the same path fails otherwise).
- :class:`Host` is a network namespace joined to the root namespace by a veth pair on a
  private /30 this module creates (10.213.N.0/30). Processes started in it reach the
  root namespace's end of the pair (PostgreSQL and the model server listen there) and
  nothing else. :meth:`Host.cut` takes both ends of the link down; :meth:`Host.heal`
  brings them back.

Failure modes: :func:`unavailable` says why this cannot run here (no ``pg_autoctl``, not
root); a formation that does not form within its timeout raises with the last
``pg_autoctl show state``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

PG_BINDIR = Path("/usr/lib/postgresql/15/bin")
PG_AUTOCTL = shutil.which("pg_autoctl") or "/usr/bin/pg_autoctl"
DBNAME = "orgchart"
#: The monitor's health checks, lowered from pg_auto_failover's defaults (5 s period,
#: 5 s timeout, 2 retries 2 s apart, 20 s unhealthy, 30 s demote timeout).
MONITOR_SETTINGS: dict[str, int] = {
    "pgautofailover.health_check_period": 1000,
    "pgautofailover.health_check_timeout": 1000,
    "pgautofailover.health_check_max_retries": 1,
    "pgautofailover.health_check_retry_delay": 500,
    "pgautofailover.node_considered_unhealthy_timeout": 2000,
    "pgautofailover.primary_demote_timeout": 3000,
}


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free right now (the formation's, so runs do not collide)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def unavailable() -> str | None:
    """Why a formation cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (pg_autoctl runs as the postgres user; namespaces need root)"
    if not Path(PG_AUTOCTL).exists():
        return "pg_autoctl is not installed (apt-get install postgresql-15-auto-failover " \
               "pg-auto-failover-cli)"
    if not (PG_BINDIR / "pg_ctl").exists():
        return f"no PostgreSQL 15 server binaries in {PG_BINDIR}"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "no postgres user"
    return None


def _as_postgres(args: Sequence[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", "env", f"PATH={PG_BINDIR}:/usr/bin:/bin",
            "HOME=" + pwd.getpwnam("postgres").pw_dir, *args]


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (read from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_tree(*roots: int) -> list[int]:
    """SIGKILL each of ``roots`` and their descendants at once; returns the PIDs signalled.

    Every process is stopped (SIGSTOP) before any is killed, so none of them serves
    anything in between (a postmaster accepting one more connection while its parent
    dies), as when a host is lost.
    """
    pids = list(dict.fromkeys(p for root in roots for p in descendants(root)))
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
    return pids


@dataclass
class Node:
    """One ``pg_autoctl`` service (the monitor or a PostgreSQL node) we started."""

    name: str
    pgdata: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    killed: bool = False

    def postmaster_pid(self) -> int | None:
        """The postmaster's PID from ``postmaster.pid``, or None."""
        try:
            return int((self.pgdata / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


@dataclass
class Formation:
    """A pg_auto_failover monitor and two nodes on loopback (see the module doc)."""

    base: Path
    monitor_port: int = 55432
    node_ports: tuple[int, int] = (55433, 55434)
    hostname: str = "127.0.0.1"
    listen: str = "*"
    settings: dict[str, int] = field(default_factory=lambda: dict(MONITOR_SETTINGS))
    #: Extra networks whose clients may connect (trust), e.g. the hosts' veth /30s.
    trusted_networks: tuple[str, ...] = ("10.213.0.0/16",)
    nodes: list[Node] = field(default_factory=list)
    monitor: Node | None = None
    log_files: list[Path] = field(default_factory=list)

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 240.0) -> None:
        """Create and run the monitor, then the two nodes; wait for primary + secondary."""
        self._clean_pg_autoctl_dirs()
        if self.base.exists():
            shutil.rmtree(self.base)
        self.base.mkdir(parents=True)
        shutil.chown(self.base, "postgres", "postgres")
        deadline = time.monotonic() + timeout
        self.monitor = self._spawn("monitor", self.monitor_port, [
            "create", "monitor", "--pgport", str(self.monitor_port)])
        self._wait(lambda: self._monitor_ready(), deadline, "the monitor")
        self._tune_monitor()
        for i, port in enumerate(self.node_ports, 1):
            node = self._spawn(f"node{i}", port, [
                "create", "postgres", "--pgport", str(port), "--dbname", DBNAME,
                "--listen", self.listen,
                "--monitor", self.monitor_uri(), "--name", f"node{i}"])
            self.nodes.append(node)
            if i == 1:
                self._wait(lambda: self._good_nodes() >= 1, deadline, "node1")
                self._trust_networks(node)  # before the standby copies pg_hba.conf
            else:
                self._wait(self._standby_ready, deadline, f"node{i}")
        self._wait(self._synchronous, deadline, "synchronous replication")

    def _trust_networks(self, node: Node) -> None:
        """Let clients from :attr:`trusted_networks` in (the hosts' workers)."""
        lines = "".join(f"host all all {net} trust\n" for net in self.trusted_networks)
        with open(node.pgdata / "pg_hba.conf", "a") as fh:
            fh.write(lines)
        psql(node, DBNAME, ["SELECT pg_reload_conf()"])

    def _spawn(self, name: str, port: int, args: list[str]) -> Node:
        pgdata = self.base / name
        log_path = self.base / f"{name}.log"
        self.log_files.append(log_path)
        cmd = _as_postgres([PG_AUTOCTL, *args, "--pgdata", str(pgdata),
                            "--hostname", self.hostname, "--auth", "trust", "--no-ssl",
                            "--run"])
        with open(log_path, "wb") as log_fh:
            proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        return Node(name, pgdata, port, proc)

    def _wait(self, ready: object, deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if ready():  # type: ignore[operator]
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{what} did not come up in time; state:\n{self.state_text()}")

    def _monitor_ready(self) -> bool:
        with psycopg.connect(self.monitor_uri(), connect_timeout=2) as conn:
            return conn.execute("SELECT count(*) FROM pgautofailover.formation").fetchone() \
                is not None

    def _tune_monitor(self) -> None:
        """``ALTER SYSTEM`` on the monitor (its health checks), then reload."""
        assert self.monitor is not None
        statements = [f"ALTER SYSTEM SET {name} = {int(value)}"
                      for name, value in self.settings.items()]
        psql(self.monitor, "pg_auto_failover", [*statements, "SELECT pg_reload_conf()"])

    def monitor_uri(self) -> str:
        """The monitor's database (trust auth, the postgres user... autoctl_node)."""
        return f"postgresql://autoctl_node@{self.hostname}:{self.monitor_port}/pg_auto_failover"

    def states(self) -> list[tuple[str, int, str, str]]:
        """``(name, port, reported_state, goal_state)`` per node, from the monitor."""
        with psycopg.connect(self.monitor_uri(), connect_timeout=2) as conn:
            rows = conn.execute(
                "SELECT nodename, nodeport, reportedstate::text, goalstate::text "
                "FROM pgautofailover.node ORDER BY nodeid").fetchall()
        return [(str(r[0]), int(r[1]), str(r[2]), str(r[3])) for r in rows]

    def state_text(self) -> str:
        """The nodes' states, one line each (for messages)."""
        try:
            return "\n".join(f"{n}:{p} {r} -> {g}" for n, p, r, g in self.states())
        except Exception as exc:  # the monitor itself may be down
            return f"(monitor unreachable: {exc})"

    def _good_nodes(self) -> int:
        states = self.states()
        if len(states) == 1:
            return int(states[0][2] in ("single", "primary") and states[0][2] == states[0][3])
        return sum(1 for _, _, r, g in states if r == g and r in ("primary", "secondary"))

    def _standby_ready(self) -> bool:
        """Whether both nodes are primary and secondary; hurries the base backup.

        The standby's ``pg_basebackup`` waits for a spread checkpoint on the primary (up
        to minutes on an idle server); an explicit ``CHECKPOINT`` finishes it at once.
        """
        if self._good_nodes() >= 2:
            return True
        with contextlib.suppress(Exception):
            psql(self.nodes[0], DBNAME, ["CHECKPOINT"])
        time.sleep(1.0)
        return False

    def _synchronous(self) -> bool:
        with psycopg.connect(self.url(direct_port=self.primary_port()), connect_timeout=2) as c:
            row = c.execute("SHOW synchronous_standby_names").fetchone()
        return bool(row and row[0])

    # ------------------------------------------------------------------ use
    def url(self, host: str | None = None, direct_port: int | None = None) -> str:
        """The multi-host URL (both nodes, read-write), or one node's URL."""
        h = host or self.hostname
        if direct_port is not None:
            return f"postgresql://postgres@{h}:{direct_port}/{DBNAME}"
        hosts = ",".join(f"{h}:{p}" for p in self.node_ports)
        return f"postgresql://postgres@{hosts}/{DBNAME}?target_session_attrs=read-write"

    def primary_port(self) -> int:
        """The port of the node that takes writes (asked directly: not in recovery)."""
        for port in self.node_ports:
            with contextlib.suppress(Exception), psycopg.connect(
                    self.url(direct_port=port), connect_timeout=2) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                if row is not None and row[0] is False:
                    return port
        raise RuntimeError(f"no primary:\n{self.state_text()}")

    def node_at(self, port: int) -> Node:
        """Our node listening on ``port``."""
        return next(n for n in self.nodes if n.port == port)

    def kill_primary(self) -> tuple[Node, float]:
        """SIGKILL the primary's pg_autoctl tree and postmaster; return it and the time."""
        node = self.node_at(self.primary_port())
        postmaster = node.postmaster_pid()
        roots = [p for p in (node.proc.pid if node.proc else None, postmaster) if p]
        kill_tree(*roots)
        killed_at = time.time()  # every process stopped: nothing commits there after this
        node.killed = True
        return node, killed_at

    def wait_failover(self, old_port: int, timeout: float = 120.0) -> int:
        """Wait until the other node is the writable primary; return its port."""
        deadline = time.monotonic() + timeout
        other = next(p for p in self.node_ports if p != old_port)
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception), psycopg.connect(
                    self.url(direct_port=other), connect_timeout=2) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                if row is not None and row[0] is False:
                    return other
            time.sleep(0.2)
        raise RuntimeError(f"no failover within {timeout}s:\n{self.state_text()}")

    # ------------------------------------------------------------------ stop
    def close(self) -> None:
        """SIGKILL every process started (trees, postmasters); remove all files."""
        for node in [*self.nodes, *([self.monitor] if self.monitor else [])]:
            postmaster = node.postmaster_pid()
            if node.proc is not None:
                kill_tree(node.proc.pid)
                with contextlib.suppress(Exception):
                    node.proc.wait(timeout=10)
            if postmaster is not None and _is_postgres(postmaster, node.pgdata):
                kill_tree(postmaster)
        time.sleep(0.2)
        self._clean_pg_autoctl_dirs()
        shutil.rmtree(self.base, ignore_errors=True)

    def _clean_pg_autoctl_dirs(self) -> None:
        home = Path(pwd.getpwnam("postgres").pw_dir)
        for top in (home / ".config" / "pg_autoctl", home / ".local" / "share" / "pg_autoctl"):
            shutil.rmtree(top / str(self.base).lstrip("/"), ignore_errors=True)
        runtime = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / "pg_autoctl"
        shutil.rmtree(runtime / str(self.base).lstrip("/"), ignore_errors=True)


def psql(node: Node, dbname: str, statements: Sequence[str]) -> str:
    """Run ``statements`` (one ``-c`` each) as the postgres superuser on ``node``'s socket."""
    lines = (node.pgdata / "postmaster.pid").read_text().splitlines()
    socket_dir = lines[4].strip() if len(lines) > 4 and lines[4].strip() else "/tmp"
    args = [a for s in statements for a in ("-c", s)]
    done = subprocess.run(_as_postgres(["psql", "-X", "-q", "-A", "-t", "-h", socket_dir,
                                        "-p", str(node.port), "-d", dbname,
                                        "-v", "ON_ERROR_STOP=1", *args]),
                          check=True, capture_output=True, timeout=30, text=True)
    return done.stdout


def _is_postgres(pid: int, pgdata: Path) -> bool:
    """Whether ``pid`` is still a postgres process for ``pgdata`` (guards PID reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return "postgres" in cmdline and str(pgdata) in cmdline


# ---------------------------------------------------------------------- hosts
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class Host:
    """A network namespace with a veth pair to the root namespace (see the module doc)."""

    name: str
    index: int
    up: bool = False

    @property
    def root_addr(self) -> str:
        """The root namespace's end of the pair (where PostgreSQL and the model listen)."""
        return f"10.213.{self.index}.1"

    @property
    def addr(self) -> str:
        """This host's address."""
        return f"10.213.{self.index}.2"

    @property
    def veth(self) -> str:
        """The root namespace's interface name."""
        return f"ocha{self.index}"

    def create(self) -> None:
        """Create the namespace and the veth pair, addresses on 10.213.N.0/30."""
        self.destroy()
        _ip("netns", "add", self.name)
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0",
            "netns", self.name)
        _ip("addr", "add", f"{self.root_addr}/30", "dev", self.veth)
        _ip("link", "set", self.veth, "up")
        _ip("-n", self.name, "addr", "add", f"{self.addr}/30", "dev", "eth0")
        _ip("-n", self.name, "link", "set", "eth0", "up")
        _ip("-n", self.name, "link", "set", "lo", "up")
        self.up = True

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` run inside this host."""
        return ["ip", "netns", "exec", self.name, *args]

    def cut(self) -> None:
        """Cut this host off: both ends of its link go down (no packet either way).

        Established connections are not closed: their sends fail silently and TCP keeps
        retransmitting, as across a real partition, until ``tcp_user_timeout`` or the
        keepalives give up. (netem packet loss would do the same; this kernel has no
        netem.)
        """
        subprocess.run(["ip", "link", "set", self.veth, "down"], check=True,
                       capture_output=True)
        subprocess.run(self.command(["ip", "link", "set", "eth0", "down"]), check=True,
                       capture_output=True)

    def heal(self) -> None:
        """Undo :meth:`cut`: both ends up, addresses (and so routes) as before."""
        for cmd in (["ip", "link", "set", self.veth, "up"],
                    self.command(["ip", "link", "set", "eth0", "up"])):
            subprocess.run(cmd, check=False, capture_output=True)

    def destroy(self) -> None:
        """Remove the pair and the namespace (idempotent)."""
        subprocess.run(["ip", "link", "del", self.veth], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)
        self.up = False
