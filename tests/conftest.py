"""Test harness: a real PostgreSQL, a migrated template database, and per-test databases.

Without ``ORGCHART_TEST_DATABASE_URL`` the session starts an embedded PostgreSQL in a
temporary directory; with it, that server is used (it must allow CREATE DATABASE).
A template database is built once per session by ``alembic upgrade head``. Fixtures:

- ``db_url``: a private database copied from the template (real commits, several
  connections, LISTEN/NOTIFY); dropped at the end of the test.
- ``store``: a :class:`runtime.store.store.Store` on ``db_url``.
- ``server_url``: the server's maintenance URL (for tests that create databases).
- ``make_runtime``: builds a runtime on ``db_url`` (offline model, ``tests.support_agents``
  unless told otherwise); ``runtime`` is its default, ``client`` an HTTP client on it. A
  test module that needs other settings or agents defines its own ``runtime`` from
  ``make_runtime``; ``client`` then follows it. ``tests/support.py`` drives them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
import sqlalchemy as sa

from runtime.store.postgres import embedded, engines, migrations, urls
from runtime.store.store import Store

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

    from runtime.wiring import Runtime

TEST_URL_ENV = "ORGCHART_TEST_DATABASE_URL"
#: The agents a test runtime loads unless the test names others.
TEST_AGENTS = ("tests.support_agents",)


def _with_database(url: str, name: str) -> str:
    return sa.engine.make_url(urls.sqlalchemy_url(url)).set(database=name).render_as_string(
        hide_password=False
    )


def _admin(url: str, *statements: str) -> None:
    with psycopg.connect(urls.libpq_url(url), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """The maintenance database URL of the server the tests use."""
    configured = os.environ.get(TEST_URL_ENV)
    if configured:
        yield urls.sqlalchemy_url(configured)
        return
    home = Path(tempfile.mkdtemp(prefix="orgchart-test-pg-"))
    os.chmod(home, 0o755)
    server = embedded.embedded_server(home / "pgdata")
    yield urls.sqlalchemy_url(server.get_uri())
    server.cleanup()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def template_db(server_url: str) -> Iterator[str]:
    """Name of a template database migrated to head, unique to this test session."""
    name = f"orgchart_tpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    _admin(server_url, f'CREATE DATABASE "{name}"')
    migrations.upgrade(_with_database(server_url, name))
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
    s = Store(engines.create_db_engine(db_url, pool_size=4))
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


@pytest.fixture
def make_runtime(db_url: str, store: Store) -> Callable[..., Runtime]:
    """Build runtimes on the test's database, with the offline model backend.

    ``make_runtime(modules=TEST_AGENTS, config=None, **env)``: ``modules`` are the agent
    modules to load, ``config`` a configuration file, and ``env`` more ``ORGCHART_*``
    variables (``make_runtime(ORGCHART_RETRY__MAX_RETRY="0")``).
    """
    from runtime.config import load_settings
    from runtime.wiring import build_runtime

    def make(modules: Sequence[str] = TEST_AGENTS, config: Path | None = None,
             **env: str) -> Runtime:
        settings = load_settings(config, env={"ORGCHART_DATABASE_URL": db_url,
                                              "ORGCHART_LLM__BACKEND": "offline", **env})
        return build_runtime(settings, list(modules), store=store)

    return make


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime]) -> Runtime:
    """A runtime on the test's database: offline model, the agents of ``tests.support_agents``."""
    return make_runtime()


@pytest.fixture
def client(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """An HTTP client on ``runtime``'s API (no API token)."""
    from fastapi.testclient import TestClient

    from runtime.http.api import create_app

    monkeypatch.delenv("ORGCHART_API_TOKEN", raising=False)
    with TestClient(create_app(store=runtime.store, settings=runtime.settings,
                               registry=runtime.registry)) as c:
        yield c
