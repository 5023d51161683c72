"""Fixtures for the high-availability suite: one pg_auto_failover formation per session.

The formation (a monitor and two PostgreSQL 15 nodes, synchronous replication, loopback
ports; :class:`bench.ha_cluster.Formation`) takes about 10 to 100 s to form, so the
session starts it once; each test gets a database of its own on whatever node is the
primary. Every test here is marked ``ha`` and skips, saying why, where a formation cannot
run (not root, no ``pg_autoctl``). Figures the tests measure go, at the end of the
session, to the file ``ORGCHART_HA_FIGURES`` names: ``python -m bench.ha`` runs this suite
with it set to ``bench/results/ha-tests.json`` and prints them; a plain test run writes a
scratch file in the temporary directory, so it never rewrites the tracked results.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bench.ha_cluster import MONITOR_SETTINGS, Formation, free_ports, unavailable
from runtime.store.postgres import migrations, urls

#: Where the figures go: ``ORGCHART_HA_FIGURES`` (``bench.ha`` sets it), else a scratch file.
RESULTS = Path(os.environ.get("ORGCHART_HA_FIGURES")
               or Path(tempfile.gettempdir()) / "orgchart-ha-figures.json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this folder ``ha`` (``-m "not ha"`` leaves them out)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.ha)


@pytest.fixture(scope="session")
def figures() -> Iterator[dict[str, Any]]:
    """What the suite measured; written to :data:`RESULTS` when the session ends."""
    found: dict[str, Any] = {}
    yield found
    if found:
        found["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        found["monitor_settings_ms"] = dict(MONITOR_SETTINGS)
        found["machine"] = f"{os.cpu_count()} cores, shared with other work (figures are noisy)"
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(found, indent=2, sort_keys=True) + "\n")
        print(f"\nha figures written to {RESULTS}:\n{json.dumps(found, indent=2)}")


@pytest.fixture(scope="session")
def formation(figures: dict[str, Any]) -> Iterator[Formation]:
    """A running formation (skips when it cannot run here); everything killed at the end."""
    why = unavailable()
    if why:
        pytest.skip(f"pg_auto_failover formation: {why}")
    if os.environ.get("ORGCHART_TEST_DATABASE_URL"):
        pytest.skip("the ha tests bring their own servers: they run in the embedded pass only")
    monitor, *nodes = free_ports(3)
    f = Formation(Path(f"/tmp/orgchart-ha-{os.getpid()}"), monitor_port=monitor,
                  node_ports=(nodes[0], nodes[1]))
    started = time.monotonic()
    try:
        f.start()
        figures["formation_start_seconds"] = round(time.monotonic() - started, 1)
        yield f
    finally:
        f.close()


def _admin(url: str, sql: str) -> None:
    with psycopg.connect(urls.libpq_url(url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql)  # type: ignore[arg-type]


@pytest.fixture
def ha_db(formation: Formation) -> Iterator[str]:
    """A migrated database of its own on the formation; the multi-host URL (libpq form)."""
    name = f"orgchart_ha_{uuid.uuid4().hex[:10]}"
    admin = formation.url().replace("/orgchart?", "/postgres?")
    _admin(admin, f'CREATE DATABASE "{name}"')
    url = formation.url().replace("/orgchart?", f"/{name}?")
    migrations.upgrade(url)
    yield url
    try:
        _admin(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except psycopg.Error as exc:  # the formation may be down to one node by now
        print(f"could not drop {name}: {exc}")
