"""Fixtures for the chaos suite: worker fleets that are always killed, and server control.

Every test here gets its own database (``db_url``); the server restart affects the whole
server, so only the chaos test does it. When the session uses the embedded server, its
handle (``runtime.store.postgres.embedded``) restarts it with ``pg_ctl``; against the
system PostgreSQL on 127.0.0.1:5432 it is ``pg_ctlcluster``; any other server cannot be
restarted from here and the restart is skipped (the test says so).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runtime.audit.history import Recorder
from tests.chaos.helpers import Fleet, ServerControl, cli_env, server_control


@pytest.fixture
def chaos_env(orgchart_env: dict[str, str]) -> dict[str, str]:
    """Environment for worker processes: prompt polling and maintenance for short leases."""
    return cli_env(orgchart_env,
                   ORGCHART_WORKER__POLL_INTERVAL_SECONDS="0.5",
                   ORGCHART_WORKER__MAINTENANCE_INTERVAL_SECONDS="0.5")


@pytest.fixture
def history(tmp_path: Path) -> Recorder:
    """The test's history (issue 40): its client operations and the faults it injected."""
    return Recorder(tmp_path / "history.jsonl", process="test")


@pytest.fixture
def server_ctl(server_url: str, history: Recorder) -> ServerControl | None:
    """How to restart the test server, or None when it cannot be restarted from here."""
    ctl = server_control(server_url)
    if ctl is not None:
        ctl.recorder = history
    return ctl


@pytest.fixture
def make_fleet(chaos_env: dict[str, str], tmp_path: Path,
               history: Recorder) -> Iterator[Callable[[list[str]], Fleet]]:
    """A factory of :class:`Fleet` s; every process they started is SIGKILLed at the end."""
    fleets: list[Fleet] = []

    def make(args: list[str]) -> Fleet:
        fleet = Fleet(chaos_env, tmp_path / f"fleet-{len(fleets)}", args, history)
        fleets.append(fleet)
        return fleet

    try:
        yield make
    finally:
        for fleet in fleets:
            fleet.close()
