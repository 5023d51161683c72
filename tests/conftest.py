"""Test harness: a real PostgreSQL, a migrated template database, and per-test databases.

Without ``ORGCHART_TEST_DATABASE_URL`` the session starts an embedded PostgreSQL in a
temporary directory; with it, that server is used (it must allow CREATE DATABASE).
A template database is built once per session by ``alembic upgrade head``. Fixtures:

- ``db_url``: a private database copied from the template (real commits, several
  connections, LISTEN/NOTIFY); dropped at the end of the test.
- ``store``: a :class:`runtime.store.store.Store` on ``db_url``.
- ``server_url``: the server's maintenance URL (for tests that create databases).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from runtime.store import db
from runtime.store.store import Store

TEST_URL_ENV = "ORGCHART_TEST_DATABASE_URL"


def _with_database(url: str, name: str) -> str:
    return sa.engine.make_url(db.sqlalchemy_url(url)).set(database=name).render_as_string(
        hide_password=False
    )


def _admin(url: str, *statements: str) -> None:
    with psycopg.connect(db.libpq_url(url), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """The maintenance database URL of the server the tests use."""
    configured = os.environ.get(TEST_URL_ENV)
    if configured:
        yield db.sqlalchemy_url(configured)
        return
    home = Path(tempfile.mkdtemp(prefix="orgchart-test-pg-"))
    os.chmod(home, 0o755)
    server = db.embedded_server(home / "pgdata")
    yield db.sqlalchemy_url(server.get_uri())
    server.cleanup()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def template_db(server_url: str) -> Iterator[str]:
    """Name of a template database migrated to head, unique to this test session."""
    name = f"orgchart_tpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    _admin(server_url, f'CREATE DATABASE "{name}"')
    db.upgrade(_with_database(server_url, name))
    yield name
    _admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def make_database(server_url: str, template: str | None = None) -> str:
    """Create a fresh database (copied from ``template`` if given); return its URL."""
    name = f"orgchart_t_{uuid.uuid4().hex[:12]}"
    suffix = f' TEMPLATE "{template}"' if template else ""
    _admin(server_url, f'CREATE DATABASE "{name}"{suffix}')
    return _with_database(server_url, name)


def drop_database(server_url: str, url: str) -> None:
    """Drop a database made by :func:`make_database`, closing its connections."""
    name = sa.engine.make_url(url).database
    _admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def db_url(server_url: str, template_db: str) -> Iterator[str]:
    """A private, migrated database for one test."""
    url = make_database(server_url, template_db)
    yield url
    drop_database(server_url, url)


@pytest.fixture
def empty_db_url(server_url: str) -> Iterator[str]:
    """A private database with no tables (migration tests)."""
    url = make_database(server_url)
    yield url
    drop_database(server_url, url)


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    """A Store on the test's private database."""
    s = Store(db.create_db_engine(db_url, pool_size=4))
    yield s
    s.dispose()


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A temporary directory other users can traverse (the embedded server runs as its own
    system user when the tests run as root; pytest keeps its own tmp root at 0700)."""
    path = Path(tempfile.mkdtemp(prefix="orgchart-test-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def orgchart_env(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Environment for running ``orgchart`` subprocesses against the test database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORGCHART_")}
    env.update({
        "ORGCHART_DATABASE_URL": db_url,
        "ORGCHART_HOME": str(tmp_path / "home"),
        "ORGCHART_LLM__BACKEND": "offline",
        "ORGCHART_CONFIG": str(tmp_path / "none.toml"),
    })
    (tmp_path / "none.toml").write_text("")
    for key in [k for k in os.environ if k.startswith("ORGCHART_")]:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        if key.startswith("ORGCHART_"):
            monkeypatch.setenv(key, value)
    return env
