"""A run's history: what each client asked and was told, and the faults injected.

One JSON object per line (Jepsen's shape). A client operation is two lines with one
``index``: ``{"type": "invoke", ...}`` when it starts, then ``ok`` (the client was told it
happened), ``fail`` (told it did not: a 4xx, a refusal) or ``info`` (outcome unknown: a
timeout, a dropped connection). Each line carries ``wall`` (seconds since the epoch, the
clock the database's timestamps are compared with) and ``mono`` (monotonic seconds),
``process`` (the client), ``op`` (submit, cancel, pause, resume, answer, approve, reject,
fork), ``args`` and, on the completion, ``value`` (what the client was told: a submit's
``id``). A fault is one line ``{"type": "fault", "fault": "kill" | "restart" |
"partition", "wall", "mono", "end", "process"}``: ``end`` is when it was over (a
restart's server back, a partition healed), ``wall`` again for an instant kill. A side
effect seen by the outside is one line ``{"type": "request", "source", "key", "wall"}``
(a model server's log of the requests it answered, by the request's identity).

:class:`Recorder` writes such a file (thread-safe; the tests and ``make torture`` use it);
:func:`load` reads one into a :class:`History`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The operations a client records.
OPERATIONS: frozenset[str] = frozenset({"submit", "cancel", "pause", "resume", "answer",
                                        "approve", "reject", "fork"})
#: The faults a test injects.
FAULTS: frozenset[str] = frozenset({"kill", "restart", "partition"})
#: How an operation completed.
OUTCOMES: frozenset[str] = frozenset({"ok", "fail", "info"})


@dataclass(frozen=True)
class Operation:
    """One client operation: its invocation and how it completed.

    Attributes:
        index: the operation's number in its history.
        op: what it was (one of :data:`OPERATIONS`).
        process: which client ran it.
        args: what it asked (``task``, ``root``, ``idempotency_key``, ...).
        outcome: ``ok``, ``fail`` or ``info`` (``info`` too when it never completed).
        value: what the client was told (a submit's ``id``, an error's ``status``).
        invoked: wall time of the invocation; completed: of the completion (None: never).

    """

    index: int
    op: str
    process: str
    args: dict[str, Any]
    outcome: str
    value: dict[str, Any]
    invoked: float
    completed: float | None

    def as_json(self) -> dict[str, Any]:
        """The operation as evidence."""
        return {"op": self.op, "index": self.index, "process": self.process,
                "args": self.args, "outcome": self.outcome, "value": self.value,
                "invoked": self.invoked, "completed": self.completed}


@dataclass(frozen=True)
class Fault:
    """One injected fault, from ``start`` to ``end`` (wall seconds)."""

    fault: str
    process: str
    start: float
    end: float

    def as_json(self) -> dict[str, Any]:
        """The fault as evidence."""
        return {"fault": self.fault, "process": self.process, "start": self.start,
                "end": self.end}


@dataclass(frozen=True)
class Request:
    """A side effect the outside saw: one request a server (``source``) answered."""

    source: str
    key: str
    at: float

    def as_json(self) -> dict[str, Any]:
        """The request as evidence."""
        return {"source": self.source, "key": self.key, "at": self.at}


@dataclass
class History:
    """A parsed history: its operations (in invocation order), faults and outside requests."""

    operations: list[Operation] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)

    def of(self, *ops: str) -> list[Operation]:
        """The operations of the given kinds."""
        return [o for o in self.operations if o.op in ops]

    def faults_between(self, start: float, end: float, slack: float) -> list[Fault]:
        """The faults whose window meets ``[start - slack, end + slack]``."""
        return [f for f in self.faults if f.start <= end + slack and f.end >= start - slack]


def load(path: Path | str) -> History:
    """Read a history file (see the module docstring); a malformed line is a ValueError."""
    invokes: dict[int, dict[str, Any]] = {}
    completions: dict[int, dict[str, Any]] = {}
    history = History()
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            kind = entry["type"]
            if kind == "fault":
                history.faults.append(Fault(entry["fault"], entry.get("process", ""),
                                            float(entry["wall"]),
                                            float(entry.get("end") or entry["wall"])))
            elif kind == "request":
                history.requests.append(Request(str(entry["source"]), str(entry["key"]),
                                                float(entry["wall"])))
            elif kind == "invoke":
                invokes[int(entry["index"])] = entry
            elif kind in OUTCOMES:
                completions[int(entry["index"])] = entry
            else:
                raise ValueError(f"unknown type {kind!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: not a history line ({exc}): {line[:200]}") from exc
    for index, inv in sorted(invokes.items()):
        done = completions.get(index, {})
        history.operations.append(Operation(
            index, inv["op"], str(inv.get("process", "")), dict(inv.get("args") or {}),
            done.get("type", "info"), dict(done.get("value") or {}), float(inv["wall"]),
            float(done["wall"]) if done else None))
    return history


class Recorder:
    """Writes a history file as operations and faults happen (thread-safe).

    Example::

        rec = Recorder(path)
        with rec.operation("submit", {"idempotency_key": key}) as told:
            task = submit(...)
            told["id"] = task["id"]      # ok when the block ends, info if it raises
    """

    def __init__(self, path: Path | str, process: str = "client") -> None:
        self.path = Path(path)
        self.process = process
        self._lock = threading.Lock()
        self._next = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("", encoding="utf-8")

    def _write(self, entry: dict[str, Any]) -> None:
        entry.setdefault("wall", time.time())
        entry.setdefault("mono", time.monotonic())
        line = json.dumps(entry, default=str)
        with self._lock, open(self.path, "a", encoding="utf-8") as out:
            out.write(line + "\n")

    def invoke(self, op: str, args: dict[str, Any], process: str | None = None) -> int:
        """Record that an operation starts; returns its index for :meth:`complete`."""
        if op not in OPERATIONS:
            raise ValueError(f"unknown operation {op!r}; one of {sorted(OPERATIONS)}")
        with self._lock:
            index, self._next = self._next, self._next + 1
        self._write({"type": "invoke", "index": index, "op": op,
                     "process": process or self.process, "args": args})
        return index

    def complete(self, index: int, outcome: str, value: dict[str, Any] | None = None,
                 op: str = "", process: str | None = None) -> None:
        """Record how operation ``index`` ended: ``ok``, ``fail`` or ``info``."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; one of {sorted(OUTCOMES)}")
        self._write({"type": outcome, "index": index, "op": op,
                     "process": process or self.process, "value": value or {}})

    @contextmanager
    def operation(self, op: str, args: dict[str, Any],
                  process: str | None = None) -> Iterator[dict[str, Any]]:
        """Record one operation around a block: ``ok`` if it returns, ``info`` if it raises.

        The block fills the yielded dict with what the client was told. A block that
        knows it was refused sets ``told["outcome"] = "fail"`` (and returns normally).
        """
        index = self.invoke(op, args, process)
        told: dict[str, Any] = {}
        try:
            yield told
        except BaseException as exc:
            self.complete(index, "info", {"error": f"{type(exc).__name__}: {exc}"[:500]},
                          op, process)
            raise
        outcome = told.pop("outcome", "ok")
        self.complete(index, outcome, told, op, process)

    def fault(self, fault: str, process: str = "", start: float | None = None,
              end: float | None = None) -> None:
        """Record one injected fault (``start`` and ``end`` default to now)."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; one of {sorted(FAULTS)}")
        now = time.time()
        self._write({"type": "fault", "fault": fault, "process": process,
                     "wall": now if start is None else start, "end": now if end is None else end})

    def request(self, source: str, key: str, at: float) -> None:
        """Record one request a server answered (its identity ``key``, at wall time ``at``)."""
        self._write({"type": "request", "source": source, "key": key, "wall": at})

    @contextmanager
    def faulting(self, fault: str, process: str = "") -> Iterator[None]:
        """Record a fault lasting as long as the block (a restart, a partition)."""
        start = time.time()
        try:
            yield
        finally:
            self.fault(fault, process, start, time.time())
