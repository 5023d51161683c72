"""Garbage collection for a process that runs a worker.

A worker holds a thousand tasks in flight, each with its coroutine, futures, rows and
buffers: CPython's cyclic collector, run every 700 container allocations by default,
then spends a large share of the event loop on scanning them, and every full
collection walks every object the process ever imported as well. Measured on the
makespan benchmark (931 tasks, 900 model calls in flight): 0.34 to 0.52 s of
collections while the tree ran, two of them full ones, against 0.05 s with
:func:`tune_gc` (young threshold 10,000, start-up objects frozen).

Reference counting still frees almost everything at once; the collector is only needed
for reference cycles (exceptions and their tracebacks, mostly), which the higher
threshold lets accumulate a little longer.
"""

from __future__ import annotations

import gc


def tune_gc(young_threshold: int) -> None:
    """Freeze what start-up made and collect the young generation less often.

    Call once the worker's parts are built, before it starts: ``gc.freeze()`` moves every
    object tracked now (modules, classes, the registry, the configuration) out of the
    collector's sight, so a full collection only walks what the work itself made. No
    collection comes first: it took 25 to 40 ms of a worker's start-up to free about a
    thousand objects of start-up garbage, which stay frozen instead. A
    ``young_threshold`` of 0 changes nothing (the interpreter's settings stay).
    """
    if young_threshold <= 0:
        return
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)
