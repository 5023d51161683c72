"""The embedded PostgreSQL starts from nothing and is shared by a second process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from runtime.store.postgres import embedded, migrations, urls

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("ORGCHART_TEST_DATABASE_URL")),
    reason="runs once, on the embedded pass",
)

PROBE = (
    "import os, psycopg; from runtime.store.postgres import urls; "
    "url = urls.resolve_url(None); "
    "c = psycopg.connect(urls.libpq_url(url)); "
    "print(c.execute('select pg_postmaster_start_time()').fetchone()[0]); c.close()"
)


def test_embedded_server_starts_from_nothing_and_a_second_process_shares_it(
        open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = open_tmp / "home"
    monkeypatch.setenv("ORGCHART_HOME", str(home))
    monkeypatch.delenv("ORGCHART_DATABASE_URL", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    url = urls.resolve_url(None)  # starts it in this process
    assert (home / "pgdata" / "PG_VERSION").exists()
    migrations.upgrade(url)
    with psycopg.connect(urls.libpq_url(url)) as conn:
        started = conn.execute("select pg_postmaster_start_time()").fetchone()[0]
    env = {k: v for k, v in os.environ.items() if k not in ("ORGCHART_DATABASE_URL",
                                                             "DATABASE_URL")}
    env["ORGCHART_HOME"] = str(home)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == str(started)
    assert migrations.current_revision(url) == migrations.HEAD_REVISION
    embedded.release_embedded(home / "pgdata")  # the last user out: it stops
    assert (home / "pgdata").resolve() not in embedded.joined_servers()
