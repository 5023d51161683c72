"""What every ``orgchart`` command shares: the consoles, exit codes, the one error handler.

:func:`handled` wraps every command (``runtime.cli.app`` applies it when it adds them), so
all commands fail alike:

- bad input (a malformed id, an unknown agent or rule, a bad configuration, a refused
  resolution, a module that cannot be imported): exit 2, one line ``error: ...``;
- the database cannot be reached, or goes away in the middle of a command: exit 1, one
  line naming the server (password hidden), never a traceback (a statement cancelled by
  ``[database] statement_timeout_ms`` says so instead);
- anything else: exit 1, one line naming the exception (``-v`` adds the traceback).

Commands that decide on a failure themselves call :func:`fail`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import click
import psycopg
import sqlalchemy as sa
import typer
from rich.console import Console
from rich.text import Text

from agents.registry import DuplicateAgent, UnknownAgent
from runtime.config import DATABASE_URL_ENVS, ConfigError, Settings, load_settings
from runtime.core.dberrors import driver_error, one_line
from runtime.errors import BadInput
from runtime.store.postgres.embedded import HOME_ENV
from runtime.store.postgres.failover import DatabaseUnavailable
from runtime.store.postgres.urls import redacted, sqlalchemy_url
from runtime.store.rows import IdempotencyConflict, NotFound, ResolveRefused
from runtime.store.steering import SteeringRefused
from runtime.views import parse_task_id

if TYPE_CHECKING:
    from runtime.store.store import Store

log = logging.getLogger("runtime.cli")

out = Console()
err = Console(stderr=True)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

#: Errors that mean "the input (arguments, configuration, modules) is wrong": exit 2.
BAD_INPUT_ERRORS: tuple[type[BaseException], ...] = (
    BadInput, UnknownAgent, DuplicateAgent, IdempotencyConflict, ResolveRefused, ConfigError,
    NotFound, ImportError, SteeringRefused,
)
#: Errors that mean "the database is unreachable or went away": exit 1 naming the server.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    sa.exc.OperationalError, sa.exc.InterfaceError, psycopg.OperationalError,
    psycopg.InterfaceError,
)

F = TypeVar("F", bound=Callable[..., Any])

# ---------------------------------------------------------------------- shared options
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
ModulesOpt = Annotated[list[str] | None, typer.Option(
    "--agents-module",
    help="Import agents and policy rules from this module (its rules are on); repeatable.")]


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code``."""
    err.print(Text.assemble(("error: ", "bold red"), message), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def print_json(value: Any) -> None:
    """Print JSON on stdout (no colour, stable key order)."""
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")
    sys.stdout.flush()


def settings() -> Settings:
    """Load the configuration (``--config`` was turned into ``ORGCHART_CONFIG``)."""
    return load_settings()


def open_runtime(modules: list[str] | None) -> Any:
    """Build every part (the model backend too) and say on stderr which backend runs."""
    from runtime.wiring import build_runtime

    runtime = build_runtime(settings(), modules or [])
    if getattr(runtime.llm_factory, "announcement", None):
        err.print(runtime.llm_factory.announcement, style="dim", markup=False, highlight=False)
    return runtime


#: The shortest id prefix a command accepts (``tree`` prints 8 characters).
ID_PREFIX_MIN = 4
#: How many candidates an ambiguous prefix lists.
ID_CANDIDATES_SHOWN = 10
_HEX = re.compile(r"^[0-9a-f]+$")


@dataclass(frozen=True)
class TaskRef:
    """A task id as a person typed it: a whole UUID, or a prefix of one (``925c0b5f``).

    Read with :meth:`parse` before the database is opened (a malformed id fails at once);
    :meth:`resolve` then turns a prefix into the one id it starts (the HTTP API and MCP
    keep taking whole ids only).
    """

    text: str
    what: str
    exact: uuid.UUID | None
    lo: uuid.UUID | None = None
    hi: uuid.UUID | None = None

    @classmethod
    def parse(cls, text: str, what: str = "task id") -> TaskRef:
        """Read ``text``; raise :class:`BadInput` unless it is a UUID or a long enough prefix."""
        try:
            return cls(text, what, parse_task_id(text, what))
        except BadInput:
            hexits = text.strip().lower().replace("-", "")
            if not (ID_PREFIX_MIN <= len(hexits) < 32 and _HEX.match(hexits)):
                raise BadInput(
                    f"{what} {text!r} is not a UUID, nor a prefix of one of "
                    f"{ID_PREFIX_MIN} or more hex characters (as 'orgchart tree' prints "
                    "ids: 925c0b5f)") from None
            pad = 32 - len(hexits)
            return cls(text, what, None, uuid.UUID(hexits + "0" * pad),
                       uuid.UUID(hexits + "f" * pad))

    def resolve(self, store: Store) -> uuid.UUID:
        """The id: the UUID given, or the one task id the prefix starts.

        Raises:
            NotFound: no task id starts with the prefix.
            BadInput: several do (they are listed, up to :data:`ID_CANDIDATES_SHOWN`).

        """
        if self.exact is not None:
            return self.exact
        rows = store.database.query("task_find_by_id_prefix", lo=self.lo, hi=self.hi,
                                    limit=ID_CANDIDATES_SHOWN + 1)
        if not rows:
            raise NotFound(f"no task id starts with {self.text.strip()!r}")
        if len(rows) == 1:
            return uuid.UUID(str(rows[0]["id"]))
        shown = "; ".join(f"{r['id']} ({r['to_agent']}, {r['status']}"
                          + (", a root)" if r["parent_id"] is None else ")")
                          for r in rows[:ID_CANDIDATES_SHOWN])
        more = " and more" if len(rows) > ID_CANDIDATES_SHOWN else ""
        raise BadInput(f"{self.what} {self.text.strip()!r} is ambiguous: it starts {shown}"
                       f"{more}; give more characters")


def server_name(config: Settings | None = None) -> str:
    """The database server a command talks to, for messages: its URL (password hidden).

    Never starts anything: without a configured URL it names the embedded server's home.
    """
    url = next((os.environ[n] for n in DATABASE_URL_ENVS if os.environ.get(n)), None)
    if url is None:
        try:
            url = (config or load_settings()).database.url
        except ConfigError:
            url = None
    if url:
        try:
            return redacted(sqlalchemy_url(url))
        except sa.exc.ArgumentError:
            return "the configured database (unparsable URL)"
    return f"the embedded PostgreSQL under ${HOME_ENV} ({os.environ.get(HOME_ENV) or '.orgchart'})"


def handled(fn: F) -> F:
    """The one error handler of every command: known errors become one line and an exit code.

    See the module docstring for the mapping. ``typer.Exit``, click's usage errors and
    ``KeyboardInterrupt`` pass through untouched.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.ClickException,
                click.Abort):
            raise
        except BAD_INPUT_ERRORS as exc:
            fail(str(exc), EXIT_BAD_INPUT)
        except DatabaseUnavailable as exc:  # its message names the server already
            fail(one_line(exc), EXIT_FAILED)
        except DATABASE_ERRORS as exc:
            if isinstance(driver_error(exc), psycopg.errors.QueryCanceled):
                fail(f"the database at {server_name()} cancelled a statement "
                     f"([database] statement_timeout_ms?): {one_line(exc)}", EXIT_FAILED)
            fail(f"cannot reach the database at {server_name()}: {one_line(exc)}", EXIT_FAILED)
        except Exception as exc:
            log.debug("command failed", exc_info=True)
            hint = "" if log.isEnabledFor(logging.INFO) else " (run with -v for the traceback)"
            if log.isEnabledFor(logging.INFO):
                import traceback

                traceback.print_exc(file=sys.stderr)
            fail(f"unexpected {type(exc).__name__}: {one_line(exc)}{hint}", EXIT_FAILED)

    return wrapper  # type: ignore[return-value]


@contextmanager
def opened_store(config: Settings | None = None) -> Iterator[Store]:
    """A Store on the configured database (migrated), disposed of at the end.

    For the commands that read or steer: a database that does not answer fails at once
    (one line, exit 1), without riding out ``[database] failover_timeout_seconds``.
    """
    from runtime.wiring import open_store  # not at import time: the CLI loads this early

    store = open_store(config or settings(), ride_out=False)
    try:
        yield store
    finally:
        store.dispose()


def install_stop_signals(stop: Callable[..., None]) -> None:
    """SIGTERM or SIGINT calls ``stop(reason)``; a second one ``stop(reason, now=True)``.

    A worker (or a fire's workers) then hands back what it holds at once instead of
    giving it the stop grace.
    """
    heard: list[str] = []

    def handler(signum: int, _frame: Any) -> None:
        heard.append(signal.Signals(signum).name)
        if len(heard) == 1:
            stop(f"signal {heard[0]}")
            return
        os.write(2, f"{heard[-1]} again: handing back the tasks in flight now\n".encode())
        stop(f"signal {heard[0]}", now=True)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
