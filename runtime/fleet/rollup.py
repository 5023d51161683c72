"""The fire's one note upward: what the workers drained, what went wrong, who must act.

:func:`build_rollup` turns what a fire collected (each worker's JSON stats, the
``task_events`` its workers wrote, failures grouped by cause, the hygiene counts, the
escalation inbox) into a :class:`Rollup`: a JSON-ready ``stats`` dict for the fires row
and a short ``text`` for people.

Counts per mode come from ``task_events`` (what was recorded), and each worker's own
report is checked against the events its id wrote; a difference is an anomaly, as is a
worker that printed no report (killed at its wall clock, or crashed).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Outcome kinds that are not progress: a transient retry, a hand-back on shutdown.
NOT_DRAINED = ("pending", "released")
#: Kinds in the order the note lists them.
KIND_ORDER = ("judging", "done", "delegated", "retried", "failed", "escalated", "pending",
              "released")
_OUTCOMES = {("running", s) for s in ("judging", "done", "failed", "escalated", "pending")} | {
    ("judging", s) for s in ("done", "failed", "escalated")}
KIND_LABELS = {"pending": "retry later", "retried": "retried children",
               "released": "released"}


@dataclass
class WorkerRun:
    """One disposable worker process the fire launched, and how it ended."""

    mode: str
    pid: int
    prefix: str
    task_cap: int
    wall_clock_seconds: float
    exit_code: int | None = None
    signal: str | None = None
    stats: dict[str, Any] | None = None
    stderr_tail: str = ""
    seconds: float = 0.0
    stopped_by_fire: bool = False

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        return {"mode": self.mode, "pid": self.pid,
                "worker": (self.stats or {}).get("worker"), "task_cap": self.task_cap,
                "wall_clock_seconds": self.wall_clock_seconds, "exit_code": self.exit_code,
                "signal": self.signal, "stopped_by_fire": self.stopped_by_fire,
                "seconds": round(self.seconds, 3), "stats": self.stats}


@dataclass(frozen=True)
class Hygiene:
    """What the fire's hygiene pass did before the fan-out."""

    released: int = 0
    poisoned: int = 0
    timed_out: int = 0
    swept: int = 0

    def as_dict(self) -> dict[str, int]:
        """A JSON-ready view."""
        return {"released": self.released, "poisoned": self.poisoned,
                "timed_out": self.timed_out, "swept": self.swept}


@dataclass
class Rollup:
    """The note: ``stats`` for the fires row, ``text`` for people."""

    stats: dict[str, Any] = field(default_factory=dict)
    text: str = ""


def stats_tally(stats: Mapping[str, Any]) -> Counter[str]:
    """What a worker says it did, in the kinds :func:`event_tally` counts."""
    tally: Counter[str] = Counter({str(k): int(v) for k, v in
                                   (stats.get("outcomes") or {}).items()})
    for key in ("delegated", "released"):
        tally[key] += int(stats.get(key) or 0)
    return +tally


def event_tally(rows: Iterable[Mapping[str, Any]]) -> dict[str, Counter[str]]:
    """Per worker id, the outcomes recorded in ``task_events`` (claims and fan-in aside)."""
    out: dict[str, Counter[str]] = {}
    for row in rows:
        src, dst, n = row["from_status"], row["to_status"], int(row["n"])
        if row["released"]:
            kind = "released"
        elif src == "running" and dst == "waiting":
            kind = "retried" if row["aggregate"] else "delegated"
        elif (src, dst) in _OUTCOMES:
            kind = dst
        else:
            continue  # claims, fan-in flips
        out.setdefault(str(row["worker"]), Counter())[kind] += n
    return out


def drained(tally: Mapping[str, int]) -> int:
    """Tasks moved forward (transient retries and hand-backs do not count)."""
    return sum(n for kind, n in tally.items() if kind not in NOT_DRAINED)


def _kinds(tally: Mapping[str, int]) -> str:
    order = [k for k in KIND_ORDER if tally.get(k)] + sorted(
        k for k in tally if k not in KIND_ORDER and tally[k])
    return ", ".join(f"{KIND_LABELS.get(k, k)} {tally[k]}" for k in order)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _worker_for(worker_id: str, runs: Sequence[WorkerRun]) -> WorkerRun | None:
    for run in runs:
        if worker_id.startswith(run.prefix):
            return run
    return None


def _run_anomalies(run: WorkerRun, by_worker: Mapping[str, Counter[str]]) -> list[str]:
    """What went wrong with one worker: how it ended, and whether its report matches the events."""
    anomalies: list[str] = []
    label = f"worker {run.pid} ({run.mode})"
    recorded: Counter[str] = Counter()
    for worker_id, tally in by_worker.items():
        if worker_id.startswith(run.prefix):
            recorded.update(tally)
    if run.signal and run.stopped_by_fire:
        anomalies.append(f"{label} terminated as the fire stopped: {run.signal} after "
                         f"{run.seconds:.1f}s")
    elif run.signal:
        anomalies.append(f"{label} outlived its wall clock of {run.wall_clock_seconds:g}s: "
                         f"{run.signal} after {run.seconds:.1f}s")
    elif run.exit_code not in (0, None):
        tail = run.stderr_tail.strip().splitlines()
        anomalies.append(f"{label} exited with code {run.exit_code}"
                         + (f": {tail[-1]}" if tail else ""))
    if run.stats is None:
        if not run.signal:
            anomalies.append(f"{label} printed no report; counted from task_events")
        return anomalies
    reported = stats_tally(run.stats)
    recorded_cmp = Counter({k: v for k, v in recorded.items() if k != "retried"})
    if reported != +recorded_cmp:
        anomalies.append(f"{label} reported {_kinds(reported) or 'nothing'} but task_events "
                         f"recorded {_kinds(recorded_cmp) or 'nothing'}")
    return anomalies


def _repair_anomalies(runs: Sequence[WorkerRun], hygiene: Hygiene) -> list[str]:
    """What hygiene and the workers had to repair (expired leases, stale writes, errors)."""
    anomalies: list[str] = []
    worker_totals: Counter[str] = Counter()
    for run in runs:
        for key in ("stale", "dropped", "reaped", "poisoned", "timed_out", "db_errors"):
            worker_totals[key] += int((run.stats or {}).get(key) or 0)
    if hygiene.released or hygiene.poisoned or hygiene.timed_out or hygiene.swept:
        anomalies.append(
            f"hygiene before the fan-out: released {hygiene.released} stranded task(s), "
            f"poisoned {hygiene.poisoned}, timed out {hygiene.timed_out}, "
            f"swept {hygiene.swept} waiting parent(s)")
    if worker_totals["reaped"] or worker_totals["poisoned"] or worker_totals["timed_out"]:
        anomalies.append(
            f"during the fan-out: reaped {worker_totals['reaped']} expired lease(s), poisoned "
            f"{worker_totals['poisoned']}, timed out {worker_totals['timed_out']}")
    if worker_totals["stale"]:
        anomalies.append(f"{worker_totals['stale']} stale write(s) ignored (lease taken away)")
    if worker_totals["dropped"]:
        anomalies.append(f"{worker_totals['dropped']} task(s) dropped by workers")
    if worker_totals["db_errors"]:
        anomalies.append(f"{worker_totals['db_errors']} database error(s) in workers (retried)")
    return anomalies


def build_rollup(*, fire_id: int, runs: Sequence[WorkerRun], hygiene: Hygiene,
                 event_rows: Iterable[Mapping[str, Any]],
                 failures: Iterable[Mapping[str, Any]],
                 escalations: Sequence[Mapping[str, Any]], left_queued: Mapping[str, int],
                 plans: int, seconds: float, notes: Sequence[str] = (),
                 now: dt.datetime | None = None) -> Rollup:
    """Assemble the rollup of one fire (see the module docstring)."""
    now = now or dt.datetime.now(dt.UTC)
    by_worker = event_tally(event_rows)
    by_mode: dict[str, Counter[str]] = {}
    for run in runs:
        by_mode.setdefault(run.mode, Counter())
    anomalies: list[str] = list(notes)
    for worker_id, tally in by_worker.items():
        owner = _worker_for(worker_id, runs)
        if owner is not None:
            by_mode[owner.mode].update(tally)
    for run in runs:
        anomalies.extend(_run_anomalies(run, by_worker))
    anomalies.extend(_repair_anomalies(runs, hygiene))

    failure_list = [{"status": f["status"], "agent": f["agent"], "error": f["error"] or "",
                     "count": int(f["n"])} for f in failures]
    person = _needs_a_person(escalations, now)
    stats = {
        "fire_id": fire_id,
        "seconds": round(seconds, 3),
        "plans": plans,
        "hygiene": hygiene.as_dict(),
        "by_mode": {mode: {"drained": drained(t), **dict(t)} for mode, t in by_mode.items()},
        "drained": sum(drained(t) for t in by_mode.values()),
        "workers": [run.as_dict() for run in runs],
        "failures": failure_list,
        "anomalies": anomalies,
        "left_queued": dict(left_queued),
        "needs_a_person": person,
    }
    return Rollup(stats, _text(stats, len(escalations)))


def _needs_a_person(escalations: Sequence[Mapping[str, Any]],
                    now: dt.datetime) -> dict[str, Any] | None:
    if not escalations:
        return None
    oldest = escalations[0]
    at = oldest.get("escalated_at") or oldest.get("completed_at") or oldest.get("created_at")
    age = (now - at).total_seconds() if isinstance(at, dt.datetime) else None
    return {"task_id": str(oldest["id"]), "agent": oldest.get("to_agent"),
            "error": oldest.get("error"), "age_seconds": age, "open": len(escalations)}


def _text(stats: Mapping[str, Any], open_escalations: int) -> str:
    runs = stats["workers"]
    lines = [f"fire {stats['fire_id']}: {stats['drained']} task(s) drained by {len(runs)} "
             f"worker(s) in {stats['seconds']:.1f}s ({stats['plans']} plan(s))"]
    modes = stats["by_mode"]
    if modes:
        lines.append("drained per mode:")
        lines += [f"  {mode}: {t['drained']}"
                  + (f" ({_kinds({k: v for k, v in t.items() if k != 'drained'})})"
                     if len(t) > 1 else "")
                  for mode, t in modes.items()]
    else:
        lines.append("drained per mode: nothing to drain")
    if stats["failures"]:
        lines.append("failures and escalations:")
        lines += [f"  {f['status']} x{f['count']} ({f['agent']}): {f['error'] or '(no error text)'}"
                  for f in stats["failures"]]
    else:
        lines.append("failures and escalations: none")
    if stats["anomalies"]:
        lines.append("anomalies:")
        lines += [f"  {a}" for a in stats["anomalies"]]
    else:
        lines.append("anomalies: none")
    left = stats["left_queued"]
    lines.append("left queued: " + (", ".join(f"{m} {n}" for m, n in left.items())
                                    if left else "nothing"))
    person = stats["needs_a_person"]
    if person is None:
        lines.append("needs a person: nothing")
    else:
        age = person["age_seconds"]
        lines.append(
            f"needs a person: task {person['task_id']} ({person['agent']}) escalated"
            + (f" {_age(age)} ago" if age is not None else "")
            + f": {person['error'] or '(no reason given)'}"
            + (f" (+{open_escalations - 1} more open)" if open_escalations > 1 else "")
            + f"; orgchart resolve {person['task_id']} --retry|--done|--fail")
    return "\n".join(lines)
