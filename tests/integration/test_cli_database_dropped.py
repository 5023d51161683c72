"""A database that goes away (or cancels a statement) mid-command: exit 1, one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
import typer
from typer.testing import CliRunner

from runtime.cli.common import handled
from runtime.store.postgres import engines, urls
from runtime.store.store import Store
from tests.conftest import drop_database
from tests.factories import submit
from tests.support import wait_until

REPO = Path(__file__).resolve().parents[2]


def _has_read_the_tree(db_url: str) -> bool:
    """Whether another session of ``db_url``'s database last ran a read of ``tasks``."""
    with psycopg.connect(urls.libpq_url(db_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND query ILIKE '%tasks%'").fetchone()
    return bool(row and row[0])


def test_a_database_dropped_mid_command_exits_1_naming_the_server(
        store: Store, db_url: str, server_url: str, orgchart_env: dict[str, str]) -> None:
    root = submit(store)  # pending for ever: no worker runs
    store.dispose()
    watcher = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "tree", str(root["id"]), "--watch",
         "--interval", "0.2", "--json"],
        env=orgchart_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The command is running: it has read the tree at least once.
        wait_until(lambda: watcher.poll() is not None or _has_read_the_tree(db_url),
                   timeout=30, what="the watcher to read the tree")
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


def test_a_statement_cancelled_by_the_timeout_says_so(db_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORGCHART_DATABASE_URL", db_url)

    def slow() -> None:
        engine = engines.create_db_engine(db_url, pool_size=1, statement_timeout_ms=100)
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT pg_sleep(5)"))
        finally:
            engine.dispose()

    probe = typer.Typer()
    probe.command("a")(handled(slow))
    probe.command("b")(handled(lambda: None))
    result = CliRunner().invoke(probe, ["a"])
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: the database at postgresql+psycopg://")
    assert "cancelled a statement ([database] statement_timeout_ms?)" in line
