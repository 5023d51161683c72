"""A database error in one line: the driver's message, folded, cut, never empty."""

from __future__ import annotations

import psycopg
import sqlalchemy as sa

from runtime.core.dberrors import driver_error, one_line, refused_value


def _wrapped(message: str) -> sa.exc.OperationalError:
    return sa.exc.OperationalError("SELECT 1", {}, psycopg.OperationalError(message))


def test_the_drivers_message_on_one_line() -> None:
    exc = _wrapped("connection failed: refused\n\tIs the server running on that host?")
    assert isinstance(driver_error(exc), psycopg.OperationalError)
    assert one_line(exc) == (
        "connection failed: refused Is the server running on that host?")
    assert one_line(exc, 17) == "connection failed"
    assert "SELECT" in str(exc) and "SELECT" not in one_line(exc)


def test_a_plain_error_and_an_empty_one() -> None:
    assert driver_error(ValueError("x")).args == ("x",)
    assert one_line(RuntimeError("  two\n lines ")) == "two lines"
    assert one_line(RuntimeError()) == "RuntimeError"


def test_a_refused_value() -> None:
    assert refused_value(_wrapped("boom")) is None  # a psycopg error built by hand: no diag
    assert refused_value(ValueError("x")) is None

    class Diag:
        message_primary = 'invalid input syntax for type uuid: "x"'

    class Driver(Exception):
        diag = Diag()

    exc = sa.exc.DataError("SELECT", {}, Driver())
    assert refused_value(exc) == 'invalid input syntax for type uuid: "x"'
