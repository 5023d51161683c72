"""Multi-host URLs, connection options and the failover error classes (no server)."""

from __future__ import annotations

import logging

import psycopg
import pytest
import sqlalchemy as sa
from psycopg.conninfo import conninfo_to_dict

from runtime.store.postgres import failover, retry, urls

FORMATION = ("postgres://postgres@127.0.0.1:55433,127.0.0.1:55434/orgchart"
             "?target_session_attrs=read-write&sslmode=prefer")


def test_a_multi_host_url_becomes_sqlalchemys_form_and_back() -> None:
    url = urls.sqlalchemy_url(FORMATION)
    parsed = sa.engine.make_url(url)
    assert parsed.query["host"] == ("127.0.0.1:55433", "127.0.0.1:55434")
    assert parsed.database == "orgchart" and parsed.username == "postgres"
    info = conninfo_to_dict(urls.libpq_url(url))
    assert info["host"] == "127.0.0.1,127.0.0.1" and info["port"] == "55433,55434"
    assert info["target_session_attrs"] == "read-write" and info["dbname"] == "orgchart"


def test_the_psycopg_dialect_gets_every_host() -> None:
    engine = sa.create_engine(urls.with_options(FORMATION, urls.ConnectionOptions()))
    _, params = engine.dialect.create_connect_args(engine.url)
    assert params["host"] == "127.0.0.1,127.0.0.1" and params["port"] == "55433,55434"
    assert params["tcp_user_timeout"] == "10000" and params["keepalives"] == "1"


def test_a_password_survives_and_is_hidden_in_messages() -> None:
    url = urls.with_options("postgresql://u:p%40ss@h1:1,h2:2/db", urls.ConnectionOptions())
    assert conninfo_to_dict(urls.libpq_url(url))["password"] == "p@ss"
    shown = urls.redacted(url)
    assert "p@ss" not in shown and "p%40ss" not in shown
    assert shown == "postgresql://u:***@h1:1,h2:2/db"  # options left out too


def test_options_do_not_override_the_urls_own_and_skip_unix_sockets() -> None:
    url = urls.with_options("postgresql://u@h:1/db?tcp_user_timeout=500",
                          urls.ConnectionOptions(tcp_user_timeout_ms=9000))
    assert sa.engine.make_url(url).query["tcp_user_timeout"] == "500"
    socket = urls.with_options("postgresql://u@/db?host=/tmp/s&port=5", urls.ConnectionOptions())
    assert "keepalives" not in sa.engine.make_url(socket).query
    single = urls.with_options("postgresql://u@h:1/db", urls.ConnectionOptions(keepalives_count=7))
    assert sa.engine.make_url(single).query["keepalives_count"] == "7"
    assert urls.redacted(single) == "postgresql+psycopg://u@h:1/db"


def test_zero_tcp_user_timeout_leaves_the_kernels() -> None:
    assert "tcp_user_timeout" not in urls.ConnectionOptions(tcp_user_timeout_ms=0).libpq()


def _err(state: str) -> psycopg.Error:
    return psycopg.errors.lookup(state)("boom")


@pytest.mark.parametrize(("state", "expected"), [
    ("25006", True), ("57P01", True), ("57P02", True), ("57P03", True), ("08006", True),
    ("08001", True), ("23505", False), ("57014", False), ("40001", False), ("22P02", False),
])
def test_failover_errors_are_classified_by_sqlstate(state: str, expected: bool) -> None:
    assert failover.is_failover_error(_err(state)) is expected
    wrapped = sa.exc.DBAPIError("SELECT 1", {}, _err(state))
    assert failover.is_failover_error(wrapped) is expected


def test_a_broken_connection_is_a_failover_error() -> None:
    assert failover.is_failover_error(psycopg.OperationalError("server closed the connection"))
    assert failover.is_failover_error(sa.exc.OperationalError(
        "SELECT 1", {}, psycopg.OperationalError("connection refused")))
    assert not failover.is_failover_error(ValueError("no"))


def test_retry_rides_out_failover_errors_and_raises_others() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise psycopg.OperationalError("gone")
        return "ok"

    assert retry.retry(flaky, timeout=10) == "ok" and len(calls) == 3
    with pytest.raises(ValueError):
        retry.retry(lambda: (_ for _ in ()).throw(ValueError("bad")), timeout=10)
    with pytest.raises(psycopg.OperationalError):
        retry.retry(lambda: (_ for _ in ()).throw(psycopg.OperationalError("x")), timeout=0)


def test_an_outage_is_logged_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    outage = failover.Outage()
    outage.level = logging.WARNING
    with caplog.at_level("WARNING", logger="runtime.store.postgres.failover"):
        for _ in range(5):
            outage.begin(psycopg.OperationalError("server closed the connection"))
        outage.end("127.0.0.1:55434")
        outage.end("127.0.0.1:55434")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "connection lost" in lines[0] and "reachable again" in lines[1]
    assert outage.outages == 1 and not outage.active


def test_cannot_reach_wrapping_a_failover_error_is_one_too() -> None:
    def wrapped(cause: BaseException) -> failover.DatabaseUnavailable:
        try:
            raise failover.DatabaseUnavailable("cannot reach postgresql://h1:1,h2:2/db") from cause
        except failover.DatabaseUnavailable as exc:
            return exc

    assert failover.is_failover_error(wrapped(psycopg.OperationalError("session is read-only")))
    assert not failover.is_failover_error(wrapped(ValueError("bad")))
    assert not failover.is_failover_error(
        failover.DatabaseUnavailable("could not start the embedded one"))
