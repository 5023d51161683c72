"""A database that goes away in the middle of a command: exit 1, one line, no traceback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from runtime.store.store import Store
from tests.conftest import drop_database
from tests.factories import submit

REPO = Path(__file__).resolve().parents[2]


def test_a_database_dropped_mid_command_exits_1_naming_the_server(
        store: Store, db_url: str, server_url: str, orgchart_env: dict[str, str]) -> None:
    root = submit(store)  # pending for ever: no worker runs
    store.dispose()
    watcher = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "tree", str(root["id"]), "--watch",
         "--interval", "0.2", "--json"],
        env=orgchart_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(4.0)  # the command is running: it has read the tree at least once
        assert watcher.poll() is None, watcher.communicate()
        drop_database(server_url, db_url)
        _out, err = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: cannot reach the database at postgresql+psycopg://")
    assert "Traceback" not in err
