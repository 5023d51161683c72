"""Chaos: four real workers drain about 1,100 tasks while we kill, restart and cut them.

While 200 root goals (190 two-level trees of 5 tasks, 10 three-level trees of 17) drain
through ``orgchart worker`` processes with a 2-second lease, each holding up to
``MAX_IN_FLIGHT`` tasks at once (the leaves are ``async def``):

- every second a random worker is SIGKILLed (one holding tasks, when there is one) and a
  new one started (one "witness" worker is never killed, so we can see a process live
  through every fault);
- at a quarter of the way the PostgreSQL server is stopped, left down for a moment and
  started again (no kills meanwhile; the loop keeps watching the progress through it);
- at half and three quarters every session on the database is terminated.

Then: the audit's checker passes the database and the run's history (kills, the
restart, the sessions cut: runtime/audit/, issue 40); every task is terminal, each has
exactly one terminal transition, no parent has a
child twice, every tree's spend equals the sum of its nodes' own spend (and of the model
calls recorded), nothing failed except by the chaos itself (a task whose lease expired
``max_delivery`` times is poison by design; a fan-out task poisoned before it delegated
leaves its subtree unmade, and the run counts on fewer tasks), no worker died on its own,
and workers that lived through each fault kept working afterwards on their own. The run
prints what it did and what held.

The kills are drawn from a seeded random generator. The seed is printed at the start
(``chaos seed N``); set ``ORGCHART_CHAOS_SEED=N`` to replay the same kill sequence.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa

from runtime.store.store import Store
from tests.chaos.helpers import (
    Fleet,
    ServerControl,
    WorkerProc,
    assert_audited,
    duplicate_children,
    events_by_pid,
    held_by,
    parent_spend_mismatches,
    reaped_count,
    server_now,
    server_started,
    spend_mismatches,
    spend_totals,
    status_counts,
    terminate_backends,
    unexplained_failures,
)
from tests.factories import terminal_event_counts

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

#: Set to replay a run's kill sequence. Read at import: the test's fixtures clear
#: ``ORGCHART_*`` from the environment before the test body runs.
SEED_ENV = "ORGCHART_CHAOS_SEED"
SEED_FROM_ENV = os.environ.get(SEED_ENV)

WORKERS = 4
LEASE_SECONDS = 2
FLAT_ROOTS, FLAT_CHILDREN = 190, 4
NESTED_ROOTS, NESTED_BRANCHES, NESTED_LEAVES = 10, 4, 3
EXPECTED_TASKS = (FLAT_ROOTS * (1 + FLAT_CHILDREN)
                  + NESTED_ROOTS * (1 + NESTED_BRANCHES * (1 + NESTED_LEAVES)))
#: How long each leaf naps before its model call: long enough that the drain outlasts the
#: kills (one a second from the third) and the restart by several seconds.
LEAF_SLEEP_SECONDS = 0.4
#: Tasks each worker holds at once (its leaves are async): enough that every kill and
#: every fault lands on many tasks in flight, few enough that one worker cannot hold the
#: whole queue (the kills would then hit only idle workers).
MAX_IN_FLIGHT = 50
KILL_EVERY_SECONDS = 1.0
FIRST_KILL_AFTER_SECONDS = 3.0  # let the first workers boot and claim
#: A kill also comes at every this much progress (fraction of tasks terminal): on a fast
#: machine the whole drain (restart included) can end before the clock's first kill.
KILL_EVERY_PROGRESS = 0.04
RESTART_AT = 0.25  # fraction of tasks terminal
RESTART_DOWNTIME_SECONDS = 1.0
TERMINATE_AT = (0.5, 0.75)
DEADLINE_SECONDS = 150.0
TICK_SECONDS = 0.2
MODULE = "tests.chaos.agents"


@dataclass
class Fault:
    """One fault we caused, for the report and the reconnect check."""

    what: str
    server_time: Any  # the database clock once the fault was over (a restart: its start)
    survivors: list[WorkerProc]  # workers alive before and after it
    detail: str = ""


@dataclass
class Journal:
    """What the chaos loop did."""

    seed: int
    kills: list[tuple[int, int]] = field(default_factory=list)  # (pid, tasks it held)
    faults: list[Fault] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _try(fn: Callable[[], Any], default: Any = None) -> Any:
    """Run a query that may hit the restart window; ``default`` when the server is away."""
    try:
        return fn()
    except sa.exc.DBAPIError:
        return default


def _scalar(store: Store, sql: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(sa.text(sql)).scalar()


def _never_delegated(store: Store) -> list[tuple[int, int]]:
    """``(n, inner)`` of each fan-out task poisoned before it delegated (chaos by design).

    A fan-out task whose lease expired ``max_delivery`` times before its delegation
    committed fails as poison with no children: its subtree is never made. On a loaded
    machine the kills reach roots still delegating; the run then has fewer tasks.
    """
    with store.engine.connect() as conn:
        return [(int(n), int(inner)) for n, inner in conn.execute(sa.text("""
            SELECT (t.payload->>'n')::int, COALESCE((t.payload->>'inner')::int, 0)
            FROM tasks t
            WHERE t.to_agent = 'spend_fanout' AND t.status = 'failed'
              AND t.error LIKE 'poison:%'
              AND NOT EXISTS (SELECT 1 FROM tasks c WHERE c.parent_id = t.id)""")).all()]


def _expected_tasks(store: Store) -> int:
    """The tasks the run makes: all of them but the subtrees never delegated."""
    return EXPECTED_TASKS - sum(n * (1 + inner) for n, inner in _never_delegated(store))


def _expected_children(store: Store) -> dict[int, int]:
    """How many parents have each number of children, the subtrees never delegated left out."""
    expected = {FLAT_CHILDREN: FLAT_ROOTS + NESTED_ROOTS,
                NESTED_LEAVES: NESTED_ROOTS * NESTED_BRANCHES}
    for n, inner in _never_delegated(store):
        expected[n] -= 1
        if inner:
            expected[inner] -= n
    return {k: v for k, v in expected.items() if v}


def _submit_roots(store: Store) -> None:
    store.tasks.submit_many("spend_fanout", "task", [
        {"goal": f"chaos flat {i}", "n": FLAT_CHILDREN, "sleep": LEAF_SLEEP_SECONDS}
        for i in range(FLAT_ROOTS)])
    store.tasks.submit_many("spend_fanout", "task", [
        {"goal": f"chaos nested {i}", "n": NESTED_BRANCHES, "inner": NESTED_LEAVES,
         "sleep": LEAF_SLEEP_SECONDS} for i in range(NESTED_ROOTS)])


class _Restart:
    """The server restart, run in a thread so the chaos loop keeps ticking through it.

    Blocking the loop for the restart call (3-4 s, of which the server is up again for the
    last seconds) let a fast drain run from a quarter to three quarters done unwatched, and
    the terminations meant for half and three quarters then came so late that little work
    was left to show that a worker lived through them. The restart counts as over once the
    server answers with a new start time.
    """

    def __init__(self, server_ctl: ServerControl, before: list[WorkerProc], progress: float,
                 old_start: Any) -> None:
        self.server_ctl, self.before, self.progress = server_ctl, before, progress
        self.old_start = old_start
        self.took: float | None = None
        self.error: BaseException | None = None
        self.fault: Fault | None = None
        self.thread = threading.Thread(target=self._run, name="chaos-restart", daemon=True)

    @classmethod
    def begin(cls, server_ctl: ServerControl | None, store: Store, fleet: Fleet,
              progress: float, journal: Journal) -> _Restart | None:
        """Start the restart, or note why there is none (then None)."""
        if server_ctl is None:
            journal.notes.append("server restart skipped: this server cannot be restarted "
                                 "from here (neither the embedded nor the system one)")
            return None
        restart = cls(server_ctl, fleet.alive(), progress, server_started(store))
        restart.thread.start()
        return restart

    def _run(self) -> None:
        try:
            self.took = self.server_ctl.restart(RESTART_DOWNTIME_SECONDS)
        except BaseException as exc:  # raised by over() in the test's thread
            self.error = exc

    def over(self, store: Store, journal: Journal) -> bool:
        """True once the server answers again after the restart (its fault then recorded,
        once, from the moment the new server started: the workers reconnect while the
        restart call still waits for the server to be ready)."""
        if self.error is not None:
            raise AssertionError(f"the server restart failed: {self.error!r}") from self.error
        if self.fault is not None:
            return True
        start = _try(lambda: _scalar(store, "SELECT pg_postmaster_start_time()"))
        if start is None or start == self.old_start:
            return False
        self.fault = Fault("server restart", start, [w for w in self.before if w.alive()])
        journal.faults.append(self.fault)
        return True

    def join(self, store: Store, journal: Journal) -> None:
        """Wait for the restart call to return (the drain may end first); describe it."""
        self.thread.join(120)
        self.over(store, journal)
        assert self.fault is not None and self.took is not None, "the restart did not end"
        self.fault.detail = (f"{self.server_ctl.description}, down "
                             f"{RESTART_DOWNTIME_SECONDS:g}s, {self.took:.1f}s in all, at "
                             f"{self.progress:.0%}")


def _run_chaos(store: Store, db_url: str, fleet: Fleet, server_ctl: ServerControl | None,
               journal: Journal) -> WorkerProc:
    """Drive the workers and the faults until every task is terminal; return the witness."""
    rng = random.Random(journal.seed)
    started = time.monotonic()
    witness = fleet.start()
    for _ in range(WORKERS - 1):
        fleet.start()
    next_kill = started + FIRST_KILL_AFTER_SECONDS
    next_kill_at = KILL_EVERY_PROGRESS
    terminations = list(TERMINATE_AT)
    restart: _Restart | None = None
    restart_begun = restart_over = False
    progress = 0.0
    while True:
        now = time.monotonic()
        counts = _try(lambda: status_counts(store))
        if counts is not None:
            total = sum(counts.values())
            terminal = sum(counts[s] for s in ("done", "failed", "escalated"))
            if terminal == total and total == _try(lambda: _expected_tasks(store)):
                break
            progress = terminal / EXPECTED_TASKS
        # else: the server is away; the last progress seen stands
        if now - started > DEADLINE_SECONDS:
            raise AssertionError(f"not drained after {DEADLINE_SECONDS:g}s: {dict(counts or {})}")

        restarting = restart_begun and not restart_over
        if not restarting and (now >= next_kill or progress >= next_kill_at):
            victims = [w for w in fleet.alive() if w is not witness]
            # A worker holding tasks when there is one: a worker still booting holds
            # nothing, and killing only those would test nothing.
            busy = [w for w in victims
                    if _try(lambda pid=w.pid: len(held_by(store, pid)), 0) > 0]
            if victims:
                victim = rng.choice(busy or victims)
                fleet.sigkill(victim)
                held = _try(lambda pid=victim.pid: held_by(store, pid), [])
                journal.kills.append((victim.pid, len(held)))
            next_kill = now + KILL_EVERY_SECONDS  # no burst to catch up after the restart
            next_kill_at = progress + KILL_EVERY_PROGRESS

        if not restart_begun and progress >= RESTART_AT:
            restart_begun = True
            restart = _Restart.begin(server_ctl, store, fleet, progress, journal)
        restart_over = restart_begun and (restart is None or restart.over(store, journal))

        # Not while the server is down (the loop keeps ticking through the restart, so a
        # mark passed then is taken at the first tick after it).
        if terminations and progress >= terminations[0] and restart_over:
            terminations.pop(0)
            before = fleet.alive()
            cut = _try(lambda: terminate_backends(db_url, fleet.recorder), 0)
            journal.faults.append(Fault("backends terminated", server_now(store),
                                        [w for w in before if w.alive()],
                                        f"{cut} sessions cut at {progress:.0%}"))

        for _ in range(WORKERS - len(fleet.alive())):
            fleet.start()
        time.sleep(TICK_SECONDS)
    journal.seconds = time.monotonic() - started
    if restart is not None:
        restart.join(store, journal)
    return witness


def _stop_all(fleet: Fleet) -> dict[int, int | None]:
    """SIGTERM every worker still alive (all at once), then collect their exit statuses."""
    alive = fleet.alive()
    for w in alive:
        w.signalled = "SIGTERM"
        w.proc.terminate()
    codes: dict[int, int | None] = {}
    for w in alive:
        try:
            codes[w.pid] = w.proc.wait(30)
        except subprocess.TimeoutExpired:
            codes[w.pid] = None  # hung; the fixture SIGKILLs it
    return codes


def _startup_failures(fleet: Fleet) -> tuple[list[WorkerProc], list[WorkerProc]]:
    """Split unsignalled exits into "could not reach the server at start" and the rest."""
    tolerated, other = [], []
    for w in fleet.unexpected_exits():
        text = w.log()
        if w.proc.returncode == 1 and "error: cannot reach" in text and "Traceback" not in text:
            tolerated.append(w)
        else:
            other.append(w)
    return tolerated, other


@dataclass
class Outcome:
    """What held (or not) after the run."""

    counts: Any
    not_once: dict[Any, int]
    tasks_with_events: int
    dupes: list[Any]
    children_per_parent: dict[int, int]
    bad_spend: list[Any]
    bad_parents: int
    spend: tuple[int, Any, int]
    call_tokens: int
    own_tokens: int
    unexplained: list[tuple[str, str, str | None]]
    reaped: int
    reconnects: list[tuple[Fault, int, dict[int, int]]]


def _check(store: Store, journal: Journal, witness: WorkerProc) -> Outcome:
    terminal = terminal_event_counts(store)
    with store.engine.connect() as conn:
        call_tokens, own_tokens = conn.execute(sa.text(
            "SELECT (SELECT COALESCE(sum(prompt_tokens + completion_tokens), 0) "
            "        FROM model_calls), (SELECT COALESCE(sum(own_tokens), 0) FROM tasks)")).one()
        children_per_parent = dict(conn.execute(sa.text(
            "SELECT n, count(*) FROM (SELECT parent_id, count(*) AS n FROM tasks "
            "WHERE parent_id IS NOT NULL GROUP BY parent_id) x GROUP BY n")).all())
    reconnects = [(f, events_by_pid(store, witness.pid, before=f.server_time),
                   {w.pid: events_by_pid(store, w.pid, after=f.server_time)
                    for w in f.survivors}) for f in journal.faults]
    return Outcome(
        counts=status_counts(store), not_once={t: n for t, n in terminal.items() if n != 1},
        tasks_with_events=len(terminal), dupes=duplicate_children(store),
        children_per_parent=children_per_parent, bad_spend=spend_mismatches(store),
        bad_parents=parent_spend_mismatches(store), spend=spend_totals(store),
        call_tokens=int(call_tokens), own_tokens=int(own_tokens),
        unexplained=unexplained_failures(store), reaped=reaped_count(store),
        reconnects=reconnects)


def _report(journal: Journal, fleet: Fleet, o: Outcome, tolerated: list[WorkerProc],
            witness: WorkerProc, witness_rc: int | None) -> None:
    tokens, usd, calls = o.spend
    print(f"\nchaos (seed {journal.seed}): {sum(o.counts.values())} tasks drained in "
          f"{journal.seconds:.1f}s; {len(fleet.workers)} worker processes started; "
          f"witness worker pid {witness.pid}")
    print(f"  did: {len(journal.kills)} SIGKILLs (killed workers held "
          f"{sum(n for _, n in journal.kills)} leased tasks between them)")
    for f, before, after in o.reconnects:
        print(f"  did: {f.what} ({f.detail}); transitions written afterwards by the workers "
              f"alive through it: {after} (witness before it: {before})")
    for note in journal.notes:
        print(f"  did: {note}")
    print(f"  workers that could not start while the server was down: {len(tolerated)}")
    print(f"  held: final statuses {dict(o.counts)}; reaper transitions {o.reaped}")
    print(f"  held: one terminal transition per task: {not o.not_once} "
          f"({o.tasks_with_events} tasks); duplicate children: {len(o.dupes)}; children per "
          f"parent: {o.children_per_parent}")
    print(f"  held: spend {tokens} tokens / ${usd} over {calls} model calls; roots whose "
          f"total differs from their tree: {len(o.bad_spend)}; inner nodes off: "
          f"{o.bad_parents}; recorded call tokens {o.call_tokens} vs own tokens "
          f"{o.own_tokens}")
    print(f"  held: failures not caused by the chaos itself: {len(o.unexplained)}; witness "
          f"exit status on SIGTERM: {witness_rc}")
    for agent, status, error in o.unexplained[:5]:
        print(f"    {agent} {status}: {(error or '')[:300]}")


def chaos_seed(configured: str | None) -> int:
    """The seed of this run: ``ORGCHART_CHAOS_SEED`` when set, else a fresh random one."""
    if configured is None or not configured.strip():
        return random.randrange(1 << 30)
    try:
        return int(configured)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV} must be an integer, not {configured!r}") from None


def test_workers_and_server_die_and_every_task_is_recorded_once(
        store: Store, db_url: str, make_fleet: Callable[[list[str]], Fleet],
        server_ctl: ServerControl | None) -> None:
    journal = Journal(seed=chaos_seed(SEED_FROM_ENV))
    print(f"\nchaos seed {journal.seed} (replay with {SEED_ENV}={journal.seed})", flush=True)
    fleet = make_fleet(["--agents-module", MODULE, "--agents", "spend_fanout,spender,judge",
                        "--lease-seconds", str(LEASE_SECONDS),
                        "--max-in-flight", str(MAX_IN_FLIGHT)])
    _submit_roots(store)
    witness = _run_chaos(store, db_url, fleet, server_ctl, journal)
    exit_codes = _stop_all(fleet)
    tolerated, crashed = _startup_failures(fleet)
    o = _check(store, journal, witness)
    _report(journal, fleet, o, tolerated, witness, exit_codes.get(witness.pid))

    logs = "\n".join(f"--- worker {w.number} pid {w.pid} exit {w.proc.returncode}:\n{w.log()}"
                     for w in crashed)
    assert not crashed, f"workers died on their own:\n{logs}"
    expected = _expected_tasks(store)
    assert sum(o.counts.values()) == expected
    assert set(o.counts) <= {"done", "failed", "escalated"}, o.counts
    assert o.tasks_with_events == expected and o.not_once == {}, o.not_once
    assert o.dupes == []
    assert o.children_per_parent == _expected_children(store)
    assert o.spend[0] > 0 and o.bad_spend == [] and o.bad_parents == 0
    assert o.call_tokens == o.own_tokens  # every charge recorded as a call, and only once
    assert o.unexplained == [], o.unexplained
    assert len(journal.kills) >= 5 and o.reaped > 0, "the kills hit nothing"
    assert exit_codes.get(witness.pid) == 0, witness.log()
    for f, before, after in o.reconnects:
        assert before > 0, f"the witness had done nothing before the {f.what}"
        assert after.get(witness.pid, 0) > 0, (
            f"the witness worker wrote nothing after the {f.what}:\n{witness.log()}")
    assert_audited(store, fleet.recorder)
