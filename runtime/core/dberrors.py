"""A database error told in one line, for a log, a refusal or a command's exit message.

SQLAlchemy wraps the driver's exception (``exc.orig``); the driver's message is the one
worth showing (the wrapper adds the SQL and a link). psycopg's messages run over several
lines (``connection failed: ...`` then a hint): they are folded into one. Duck-typed on
``orig`` and ``diag``, so this module needs neither SQLAlchemy nor psycopg.
"""

from __future__ import annotations


def driver_error(exc: BaseException) -> BaseException:
    """The driver's exception under SQLAlchemy's wrapper (``exc.orig``), or ``exc`` itself."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def one_line(exc: BaseException, limit: int | None = None) -> str:
    """The driver's message of ``exc`` on one line (white space folded), at most ``limit``.

    An empty message gives the exception's class name.
    """
    text = " ".join(str(driver_error(exc)).split())[:limit]
    return text or type(exc).__name__


def refused_value(exc: BaseException) -> str | None:
    """The server's primary message of a refused value (psycopg's ``diag``), or None."""
    diag = getattr(driver_error(exc), "diag", None)
    primary = getattr(diag, "message_primary", None)
    return str(primary) if primary else None
