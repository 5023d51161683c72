"""``GET /metrics`` for Prometheus: a collector that reads the database at scrape time.

Gauges are read whole at every scrape from the unfinished rows only (index range scans:
a table of millions of finished tasks costs nothing). Counters and histograms are kept
in this process: each scrape reads only the ``task_events`` and ``model_calls`` rows
written since the previous one (by id, on their primary keys) and adds them up, so
they count from this process's first scrape (exposed as each counter's ``_created``),
which is how Prometheus counters behave across restarts (``rate()`` handles resets).

``prometheus_client`` is imported by this module only; the API imports it lazily, on
the first scrape.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from runtime.store.store import Store

#: Upper bounds (seconds) of the task wall-time histogram (created to completed).
TASK_DURATION_BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
#: Upper bounds (seconds) of the model-call latency histogram.
MODEL_CALL_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: The text exposition format (Prometheus 0.0.4) and OpenMetrics 1.0.
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = openmetrics.CONTENT_TYPE_LATEST

_QUEUED = ("pending", "ready_to_aggregate")


class _Histogram:
    """Cumulative bucket counts and a sum, fed with ``width_bucket`` results."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def add(self, bucket: int, n: int, seconds: float) -> None:
        # width_bucket gives 0 below the first bound, i for bounds[i-1] <= x < bounds[i],
        # len(bounds) at or past the last: that index is the first bound above x.
        self.counts[min(max(bucket, 0), len(self.bounds))] += n
        self.total += seconds

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == math.inf else repr(bound), running))
        return out


class StoreCollector:
    """A ``prometheus_client`` collector over one :class:`Store` (thread-safe)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._cursors: tuple[int, int] | None = None
        self._started = time.time()
        self._transitions: dict[tuple[str, str, str], int] = defaultdict(int)
        self._reaped: dict[str, int] = defaultdict(int)
        self._poisoned: dict[str, int] = defaultdict(int)
        self._retries: dict[str, int] = defaultdict(int)
        self._durations: dict[tuple[str, str], _Histogram] = {}
        self._calls: dict[tuple[str, str], dict[str, Any]] = {}
        self._latency: dict[tuple[str, str], _Histogram] = {}

    def describe(self) -> list[Metric]:
        """Nothing up front: registering must not read the database."""
        return []

    def _absorb(self, snap: dict[str, Any]) -> None:
        for r in snap["events"]:
            agent = r["agent"] or "unknown"
            key = (r["from_status"] or "none", r["to_status"], agent)
            self._transitions[key] += int(r["n"])
            self._reaped[agent] += int(r["reaped"])
            self._poisoned[agent] += int(r["poisoned"])
            retried = r["from_status"] == "running" and r["to_status"] == "pending"
            self._retries[agent] += int(r["n"]) - int(r["reaped"]) if retried else 0
            if r["bucket"] is not None:
                hist = self._durations.setdefault((agent, r["to_status"]),
                                                  _Histogram(TASK_DURATION_BOUNDS))
                hist.add(int(r["bucket"]), int(r["n"]), float(r["seconds"]))
        for r in snap["calls"]:
            call_key = (str(r["route"]), str(r["model"]))
            c = self._calls.setdefault(call_key, {"n": 0, "errors": 0, "input": 0, "output": 0,
                                                  "usd": Decimal(0)})
            c["n"] += int(r["n"])
            c["errors"] += int(r["errors"])
            c["input"] += int(r["input_tokens"] or 0)
            c["output"] += int(r["output_tokens"] or 0)
            c["usd"] += Decimal(r["cost_usd"] or 0)
            self._latency.setdefault(call_key, _Histogram(MODEL_CALL_BOUNDS)).add(
                int(r["bucket"]), int(r["n"]), float(r["seconds"] or 0))

    def collect(self) -> Iterator[Metric]:
        """Read the database once and yield every metric family."""
        t0 = time.perf_counter()
        with self._lock:
            after = self._cursors or (None, None)
            snap = self.store.reads.metrics_scrape(after[0], after[1], TASK_DURATION_BOUNDS,
                                                   MODEL_CALL_BOUNDS)
            self._absorb(snap)
            self._cursors = snap["cursors"]
            yield from self._live(snap)
            yield from self._counted()
        scrape = GaugeMetricFamily("orgchart_scrape_duration_seconds",
                                   "How long this scrape's database reads took.")
        scrape.add_metric([], time.perf_counter() - t0)
        yield scrape

    def _live(self, snap: dict[str, Any]) -> Iterator[Metric]:
        tasks = GaugeMetricFamily("orgchart_tasks", "Unfinished tasks by status and agent.",
                                  labels=["status", "agent"])
        depth = GaugeMetricFamily("orgchart_queue_depth",
                                  "Tasks waiting to be claimed (pending or ready to "
                                  "aggregate) by agent.", labels=["agent"])
        oldest = GaugeMetricFamily("orgchart_queue_oldest_age_seconds",
                                   "Age of the oldest claimable task by agent.",
                                   labels=["agent"])
        queued: dict[str, int] = defaultdict(int)
        first: dict[str, float] = {}
        now = time.time()
        for r in snap["live"]:
            tasks.add_metric([r["status"], r["agent"]], int(r["n"]))
            if r["status"] in _QUEUED:
                queued[r["agent"]] += int(r["n"])
            if r["oldest_claimable"] is not None:
                ts = r["oldest_claimable"].timestamp()
                first[r["agent"]] = min(first.get(r["agent"], ts), ts)
        for agent, n in sorted(queued.items()):
            depth.add_metric([agent], n)
        for agent, ts in sorted(first.items()):
            oldest.add_metric([agent], max(0.0, now - ts))
        flight = GaugeMetricFamily("orgchart_worker_tasks_in_flight",
                                   "Leased tasks per worker (running, or being judged).",
                                   labels=["worker", "status"])
        for r in snap["leases"]:
            flight.add_metric([r["worker"] or "unknown", r["status"]], int(r["n"]))
        yield from (tasks, depth, oldest, flight)

    def _counter(self, name: str, doc: str, labels: list[str],
                 values: dict[Any, Any]) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=labels)
        for key, value in sorted(values.items()):
            family.add_metric(list(key) if isinstance(key, tuple) else [key], float(value),
                              created=self._started)
        return family

    def _counted(self) -> Iterator[Metric]:
        yield self._counter("orgchart_task_transitions",
                            "Task status transitions (task_events rows) by kind and agent.",
                            ["from_status", "to_status", "agent"], self._transitions)
        yield self._counter("orgchart_tasks_reaped",
                            "Transitions made by the reaper (expired leases).", ["agent"],
                            self._reaped)
        yield self._counter("orgchart_tasks_poisoned",
                            "Tasks failed as poison (lease expired on every delivery).",
                            ["agent"], self._poisoned)
        yield self._counter("orgchart_task_retries",
                            "Runs that failed and went back to pending for another try.",
                            ["agent"], self._retries)
        yield self._histogram("orgchart_task_duration_seconds",
                              "Wall time of finished tasks, created to completed.",
                              ["agent", "status"], self._durations)
        calls = self._calls.items()
        yield self._counter("orgchart_model_calls", "Model calls by route and model.",
                            ["route", "model"], {k: c["n"] for k, c in calls})
        yield self._counter("orgchart_model_call_errors",
                            "Model calls that ended with an error (retried or repaired "
                            "by the model layer, or given up).", ["route", "model"],
                            {k: c["errors"] for k, c in calls})
        tokens = {(*k, "input"): c["input"] for k, c in calls}
        tokens.update({(*k, "output"): c["output"] for k, c in calls})
        yield self._counter("orgchart_model_tokens", "Model tokens by route, model and "
                            "direction (input: prompt, output: completion).",
                            ["route", "model", "direction"], tokens)
        yield self._counter("orgchart_model_cost_usd", "Model cost in USD by route and model.",
                            ["route", "model"], {k: c["usd"] for k, c in calls})
        yield self._histogram("orgchart_model_call_duration_seconds",
                              "Model-call latency.", ["route", "model"], self._latency)

    def _histogram(self, name: str, doc: str, labels: list[str],
                   values: dict[tuple[str, str], _Histogram]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=labels)
        for key, hist in sorted(values.items()):
            family.add_metric(list(key), hist.buckets(), hist.total)
        return family


def registry_for(store: Store) -> CollectorRegistry:
    """A registry holding one :class:`StoreCollector` on ``store``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))  # type: ignore[arg-type]
    return registry


def exposition(registry: CollectorRegistry, fmt: str) -> tuple[bytes, str]:
    """Scrape ``registry`` in ``fmt`` ("openmetrics" or "text"): body and content type."""
    if fmt == "openmetrics":
        return openmetrics.generate_latest(registry), OPENMETRICS_CONTENT_TYPE
    return generate_latest(registry), TEXT_CONTENT_TYPE
