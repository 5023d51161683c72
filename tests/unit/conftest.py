"""Unit tests touch no server: asking for a database fixture here is an error.

A test that needs PostgreSQL (or a server in a subprocess) belongs in
``tests/integration``.
"""

from __future__ import annotations

import pytest

#: The fixtures of ``tests/conftest.py`` that start or use the PostgreSQL server.
SERVER_FIXTURES = frozenset({"server_url", "template_db", "db_url", "empty_db_url", "store",
                             "orgchart_env"})


@pytest.fixture(autouse=True)
def _no_server(request: pytest.FixtureRequest) -> None:
    wanted = SERVER_FIXTURES.intersection(request.fixturenames)
    if wanted:
        pytest.fail(f"{request.node.nodeid} is a unit test but asks for {sorted(wanted)}: "
                    "move it to tests/integration", pytrace=False)
