"""The command line, ``orgchart``: one module per group of commands, one error handler.

:func:`main` is the entry point, and imports the CLI with the collector paused: importing
it builds some 70,000 objects (modules, classes, pydantic models, the SQLAlchemy and
psycopg machinery), almost none of them garbage, yet CPython's cyclic collector runs
every 700 allocations meanwhile and walks them again each time. They are then frozen
(``gc.freeze``: never walked again; the thousand or so objects of import-time garbage
among them stay), and the collector runs again, at the interpreter's thresholds,
before the command does anything. A worker on an empty queue, start to exit: 0.536 s
without, 0.487 s with (medians of 12, alternated, an empty queue).
"""

from __future__ import annotations

import gc


def main() -> None:
    """Console-script entry point (``orgchart``, ``python -m runtime.cli``)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        from runtime.cli.app import main as run
    finally:
        # Out of the collector's sight for good: else its first pass after the pause
        # walks all of them at once, and takes back what the pause saved.
        gc.freeze()
        if was_enabled:
            gc.enable()
    run()
