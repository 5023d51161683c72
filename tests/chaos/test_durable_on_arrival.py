"""Chaos: a worker SIGKILLed in a burst of answers loses none of those that had arrived.

``TASKS`` root tasks for ``spender`` (an ``async`` agent that makes one model call, its
prompt named by its task's goal, so every request is its own; the judge then makes one
more per task) run on one ``orgchart worker`` against the loopback fake Ollama server.
The server holds every call ``CALL_SECONDS`` and up to ``SPREAD_SECONDS`` more (by the
request: the same request waits as long every time), so the answers leave it in a burst
of a few hundred a second. Once half of them have been sent, the worker is SIGKILLed,
and a new one takes the tasks over (the leases are short) and finishes them.

What must hold (SPEC section 15, issue 44): a reply is recorded the moment it arrives,
before anything else handles it, so from the server's own log (``sent_log``: when each
answer's last byte was written; ``arrival_log``: when each request came) no answer that
left the server ``MARGIN_SECONDS`` or more before the kill was requested is asked for
again, but for at most ``LOST_SHARE`` of them (the issue's goal; a loaded machine once
left one of about sixty unrecorded): the new worker replays them. A recorded answer is
one whose commit reached the disk, and no runtime makes that faster than the database
commits: on a loaded machine a single durable commit takes tens of milliseconds, so the
margin is ``MARGIN_SECONDS`` plus the slowest of a few durable commits timed just before
the burst (both printed).
Every task ends ``done``, its spend is what its recorded calls cost, and ``orgchart
audit``'s checker finds no violation in the database and the test's history (the SIGKILL
and the server's log of answers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import sqlalchemy as sa

from runtime.store.store import Store
from tests.chaos.helpers import (
    Fleet,
    assert_audited,
    audited,
    cli_env,
    record_model_server,
    status_counts,
    unfinished,
    wait_until,
)
from tests.fake_ollama import FakeOllama, fake_ollama_server, request_identity  # noqa: F401

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

TASKS = 80
#: How long the server holds each call (every request is out before an answer is), and
#: the most it adds, by the request (so the answers are not all sent at one instant).
#: (Answers the dead worker never read are sent within the audit's slack of the kill.)
CALL_SECONDS = 0.3
SPREAD_SECONDS = 0.6
#: An answer sent this long before the kill was requested must have been recorded.
MARGIN_SECONDS = 0.020
LEASE_SECONDS = 2
#: The share of those answers that may be asked for again (issue 44's goal for the bench).
LOST_SHARE = 0.02
#: The dense burst: this many tasks, their answers spread over this long.
BURST_TASKS = 240
BURST_SPREAD_SECONDS = 0.1


def _commit_seconds(store: Store, probes: int = 5) -> float:
    """The slowest of ``probes`` one-record durable commits (a WAL flush each) on ``store``."""
    slowest = 0.0
    with store.engine.connect() as conn:
        for _ in range(probes):
            started = time.perf_counter()
            conn.execute(sa.text("SELECT pg_logical_emit_message(true, 'orgchart-probe', '')"))
            conn.commit()
            slowest = max(slowest, time.perf_counter() - started)
    return slowest


def _calls(store: Store) -> sa.Row[tuple[int, int, int]]:
    """Paid calls recorded, calls replayed, and tasks whose spend is not their calls' cost."""
    with store.engine.connect() as conn:
        return conn.execute(sa.text("""
            SELECT (SELECT count(*) FROM model_calls WHERE NOT replayed) AS paid,
                   (SELECT count(*) FROM model_calls WHERE replayed) AS replayed,
                   (SELECT count(*) FROM tasks t WHERE t.own_tokens <> (
                        SELECT COALESCE(sum(m.prompt_tokens + m.completion_tokens), 0)
                        FROM model_calls m WHERE m.task_id = t.id)) AS mischarged""")).one()


def _journal_only(store: Store) -> int:
    """Replies journaled on arrival whose charge has not committed (the next delivery's)."""
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text("""
            SELECT count(*) FROM call_replies r
            WHERE NOT EXISTS (
                SELECT 1 FROM model_calls m
                WHERE m.task_id = r.task_id AND NOT m.replayed
                  AND m.attempt = CAST(r.reply->>'attempt' AS int)
                  AND m.call_index = CAST(r.reply->>'call_index' AS int)
                  AND m.call_try = CAST(r.reply->>'call_try' AS int)
                  AND m.phase = r.reply->>'phase')""")).scalar_one())


def _what_became_of(store: Store, fake_ollama: FakeOllama, keys: list[str],
                    kill_requested: float) -> str:
    """Each request asked for again: when the server saw and answered it, and its rows."""
    lines = []
    for key in keys:
        body = next(b for b in fake_ollama.arrived if request_identity(b) == key)
        prompt = str((body.get("messages") or [{}])[-1].get("content", ""))
        seen = [round(at - kill_requested, 3) for k, at in fake_ollama.arrival_log if k == key]
        sent = [round(at - kill_requested, 3) for k, at in fake_ollama.sent_log if k == key]
        with store.engine.connect() as conn:
            rows = conn.execute(sa.text("""
                SELECT m.id, m.task_id, m.attempt, m.phase, m.call_try, m.attempt_kind,
                       m.replayed, m.error,
                       extract(epoch FROM m.created_at) - :kill AS at
                FROM model_calls m WHERE m.prompt = :prompt OR position(:prompt IN m.prompt) > 0
                ORDER BY m.id"""), {"prompt": prompt, "kill": kill_requested}).all()
        lines.append(f"{key[:12]} arrived at {seen} s, sent at {sent} s (from the kill); "
                     f"rows: {[tuple(r) for r in rows]}")
    return "\n".join(lines)


@dataclass
class _Burst:
    """What one SIGKILL in a burst of answers left (see :func:`_kill_in_a_burst`)."""

    kill_requested: float
    margin: float
    before: set[str]
    at_kill: sa.Row[tuple[int, int, int]]

    def asked_again(self, fake_ollama: FakeOllama, older: float) -> list[str]:
        """Answers sent ``older`` s or more before the kill that were asked for after it."""
        sent = {key for key, at in fake_ollama.sent_log if at <= self.kill_requested - older}
        return sorted({key for key, at in fake_ollama.arrival_log
                       if at > self.kill_requested and key in sent})


def _kill_in_a_burst(store: Store, fake_ollama: FakeOllama, fleet: Fleet, tasks: int,
                     spread: float, *, group: bool) -> _Burst:
    """Run ``tasks`` spenders, SIGKILL the worker (``group``: with its recorder process)
    once half the answers left the server, let a new worker finish; audit it all."""
    fake_ollama.delay_for = lambda body: CALL_SECONDS + spread * int(
        request_identity(body)[:8], 16) / 0xFFFFFFFF
    store.tasks.submit_many("spender", "task", [{"goal": f"answer {i}"} for i in range(tasks)])
    fleet.env = cli_env(fleet.env, ORGCHART_LLM__BACKEND="ollama",
                        ORGCHART_OLLAMA__URL=fake_ollama.url,
                        ORGCHART_OLLAMA__MAX_PARALLEL="1000",
                        ORGCHART_OLLAMA__CLOUD_MAX_PARALLEL="1000")
    commit = _commit_seconds(store)
    margin = MARGIN_SECONDS + commit
    first = fleet.start(new_session=group)
    try:
        wait_until(lambda: len(fake_ollama.sent_log) >= tasks // 2, 90,
                   "half of the answers to leave the server", interval=0.002)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {len(fake_ollama.sent_log)} sent; now "
                             f"{dict(status_counts(store))}\n{first.log()}") from None
    kill_requested = time.time()
    fleet.sigkill(first, group=group)
    # The dead worker's requests outlive it on the server: held up to CALL_SECONDS +
    # spread, each is answered after the kill (to a closed socket, or to the recorder
    # that outlived the worker), and may be asked again by the new worker. Part of the
    # fault, so the history says so.
    assert fleet.recorder is not None
    fleet.recorder.fault("kill", "the dead worker's requests still held by the server",
                         kill_requested, kill_requested + CALL_SECONDS + spread)
    at_kill, journaled = _calls(store), _journal_only(store)
    fleet.start()
    wait_until(lambda: unfinished(store) == 0, 120,
               f"every task to finish; now {dict(status_counts(store))}")
    burst = _Burst(kill_requested, margin,
                   {key for key, at in fake_ollama.sent_log if at <= kill_requested - margin},
                   at_kill)
    end = _calls(store)
    print(f"\nat the kill: {len(burst.before)} answers sent {margin * 1000:.0f} ms or more "
          f"before it ({MARGIN_SECONDS * 1000:.0f} ms + the slowest durable commit, "
          f"{commit * 1000:.1f} ms), {at_kill.paid} calls recorded and {journaled} "
          "journaled only; asked again after it: "
          f"{len(burst.asked_again(fake_ollama, margin))} of those, "
          f"{len(burst.asked_again(fake_ollama, 0.0))} of all sent before it; "
          f"{end.replayed} replayed, {fake_ollama.received} requests for {end.paid} paid calls")
    assert status_counts(store) == {"done": tasks}
    # (A sixth: at 2.4 answers a millisecond, the answers of the margin before the kill
    # are a good part of the half that triggers it.)
    assert len(burst.before) >= tasks // 6, "the kill came before the burst"
    assert end.mischarged == 0
    assert not fleet.unexpected_exits()
    # The database against the contract, with the kill in the history.
    assert_audited(store, fleet.recorder)
    # Then the model server's own record of what it answered: no request is answered
    # twice outside the kill's window. (This once failed now and then: the fake server's
    # accept backlog was socketserver's 5, and a dead worker's requests, stuck behind it,
    # reached the server seconds after the kill. Its backlog is a real server's now.)
    record_model_server(fleet.recorder, fake_ollama)
    report = audited(store, fleet.recorder)
    assert report.ok, report.text()
    return burst


def test_no_answer_that_arrived_before_a_sigkill_is_asked_for_again(
        store: Store, fake_ollama: FakeOllama,
        make_fleet: Callable[[list[str]], Fleet]) -> None:
    fleet = make_fleet(["--agents-module", "tests.chaos.agents", "--agents", "spender,judge",
                        "--lease-seconds", str(LEASE_SECONDS)])
    # The worker and its recorder process die together (a container's or a unit's stop):
    # what counts is how soon a reply is on record after it arrived. The recorder
    # journals each reply at once (call_replies), then charges it; the new worker adopts
    # the journaled replies whose charge never committed and replays them.
    burst = _kill_in_a_burst(store, fake_ollama, fleet, TASKS, SPREAD_SECONDS, group=True)
    # The goal (<= 2%): at this burst's pace the answers are recorded as they come.
    # A failure says what became of each answer asked for again (its times and its rows).
    again = burst.asked_again(fake_ollama, burst.margin)
    assert len(again) <= LOST_SHARE * len(burst.before), (
        f"{len(again)} of {len(burst.before)} answers sent before the kill were asked for "
        "again:\n" + _what_became_of(store, fake_ollama, again, burst.kill_requested))


def test_a_worker_killed_alone_pays_for_no_answer_sent_before_its_death(
        store: Store, fake_ollama: FakeOllama,
        make_fleet: Callable[[list[str]], Fleet]) -> None:
    fleet = make_fleet(["--agents-module", "tests.chaos.agents", "--agents", "spender,judge",
                        "--lease-seconds", str(LEASE_SECONDS)])
    # A burst ten times as dense (BURST_TASKS answers within BURST_SPREAD_SECONDS): more
    # than a worker records as it comes. The worker alone dies (the OOM killer, kill -9);
    # its recorder process reads and records every answer that reaches it.
    burst = _kill_in_a_burst(store, fake_ollama, fleet, BURST_TASKS, BURST_SPREAD_SECONDS,
                             group=False)
    again = burst.asked_again(fake_ollama, 0.0)
    sent = [key for key, at in fake_ollama.sent_log if at <= burst.kill_requested]
    assert not again, (
        f"{len(again)} of {len(sent)} answers sent before the kill were asked for again:\n"
        + _what_became_of(store, fake_ollama, again, burst.kill_requested))
