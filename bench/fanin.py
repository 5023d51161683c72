"""Fan-in latency: a parent with 10,000 children becomes claimable when the last one ends.

One parent delegates ``children`` children (``store.transitions.delegate``, one statement).
Two paths:

- **immediate flip**: the children go through the store as a worker drives them
  (``claim`` -> ``finish_running`` to ``judging`` -> ``claim_judging`` ->
  ``finish_judging`` to ``done``) in batches of ``batch``; the last ``last_batch``
  children end in one final ``finish_judging``, whose transaction also flips the parent
  to ``ready_to_aggregate``. The figure is the time from the start of that final call
  (the commit of the last child's terminal state happens inside it) until a claim for
  the parent's agent returns the parent: an upper bound on commit-to-claimable.
- **sweeper only**: the children are set ``done`` by plain SQL (no flip, as after a
  crash or a hand edit); from that commit, ``Sweeper.run_once()`` then the same claim.
  In a worker the sweeper runs every ``maintenance_interval_seconds`` (1 s by default),
  which adds up to that interval on top of the figure.

Repeated ``repeats`` times per path (each with a fresh parent of ``children`` children).

    python -m bench.fanin [--children 10000] [--repeats 5] [--batch 500]
"""

from __future__ import annotations

import argparse
import time
import uuid
from decimal import Decimal
from typing import Any

from bench.common import connect, median, ms, open_store, percentile, report, scratch_database
from runtime.engine.maintenance import Sweeper
from runtime.store.rows import ChildRow, JudgeOutcome, NewTask, RunOutcome
from runtime.store.store import Store

PARENT_AGENT = "fanout"
CHILD_AGENT = "echo"
WORKER = "bench-fanin"
LEASE_SECONDS = 600.0


def make_parent(store: Store, children: int) -> uuid.UUID:
    """Submit a parent, claim it, and delegate ``children`` children; return its id."""
    task, _ = store.tasks.submit(NewTask(PARENT_AGENT, "work", {"goal": "fan-in bench"},
                                         idempotency_key=f"fanin-{uuid.uuid4().hex}"))
    claimed = store.claims.claim([PARENT_AGENT], 1, WORKER, LEASE_SECONDS)
    if not claimed or claimed[0]["id"] != task["id"]:
        raise RuntimeError("could not claim the fan-in parent")
    rows = [ChildRow(CHILD_AGENT, "work", {"goal": f"part {i}"}, f"part-{i}", budget_tokens=0,
                     budget_seconds=300, budget_usd=Decimal(0)) for i in range(children)]
    applied, inserted = store.transitions.delegate(task["id"], claimed[0]["lease_token"], rows,
                                                   WORKER)
    if not applied or inserted != children:
        raise RuntimeError(f"delegation failed: applied={applied} inserted={inserted}")
    return task["id"]


def finish_children(store: Store, n: int) -> float:
    """Drive up to ``n`` pending children to ``done``; return the seconds of the final call."""
    running = store.claims.claim([CHILD_AGENT], n, WORKER, LEASE_SECONDS)
    store.transitions.finish_running([RunOutcome(r["id"], r["lease_token"], "judging",
                                                 result={"ok": True})
                                      for r in running], WORKER)
    judging = store.claims.claim_judging(n, WORKER, LEASE_SECONDS)
    outcomes = [JudgeOutcome(r["id"], r["lease_token"], "done", verdict={"pass": True})
                for r in judging]
    started = time.perf_counter()
    store.transitions.finish_judging(outcomes, WORKER)
    return time.perf_counter() - started


def claim_parent(store: Store, parent_id: uuid.UUID, timeout: float = 30.0) -> None:
    """Claim until the parent comes back (its aggregate phase); raise past ``timeout``."""
    deadline = time.perf_counter() + timeout
    while True:
        rows = store.claims.claim([PARENT_AGENT], 1, WORKER, LEASE_SECONDS)
        if rows and rows[0]["id"] == parent_id:
            return
        if time.perf_counter() > deadline:
            raise TimeoutError(f"parent {parent_id} never became claimable")


def immediate_once(store: Store, children: int, batch: int, last_batch: int) -> dict[str, float]:
    """One parent through the immediate-flip path; seconds from the last finish to claimed."""
    parent = make_parent(store, children)
    remaining = children
    batch_times = []
    while remaining > last_batch:
        size = min(batch, remaining - last_batch)
        batch_times.append(finish_children(store, size))
        remaining -= size
    # the last batch: claim and judge-lease it first, then time the final call + the claim
    running = store.claims.claim([CHILD_AGENT], remaining, WORKER, LEASE_SECONDS)
    store.transitions.finish_running([RunOutcome(r["id"], r["lease_token"], "judging",
                                                 result={"ok": True})
                                      for r in running], WORKER)
    judging = store.claims.claim_judging(remaining, WORKER, LEASE_SECONDS)
    outcomes = [JudgeOutcome(r["id"], r["lease_token"], "done", verdict={"pass": True})
                for r in judging]
    started = time.perf_counter()
    done = store.transitions.finish_judging(outcomes, WORKER)
    finished = time.perf_counter()
    claim_parent(store, parent)
    claimed = time.perf_counter()
    if done.parents_ready != [parent]:
        raise RuntimeError("the last finish did not flip the parent")
    return {"latency": claimed - started, "last_finish": finished - started,
            "batch_median": median(batch_times) if batch_times else 0.0}


def sweeper_once(store: Store, url: str, children: int) -> dict[str, float]:
    """One parent through the sweeper-only path; seconds from the SQL commit to claimed."""
    parent = make_parent(store, children)
    with connect(url) as conn:
        conn.execute("UPDATE tasks SET status = 'done', completed_at = now(), updated_at = now() "
                     "WHERE parent_id = %s", (parent,))
    committed = time.perf_counter()
    swept = Sweeper(store).run_once()
    after_sweep = time.perf_counter()
    claim_parent(store, parent)
    claimed = time.perf_counter()
    if parent not in swept.ids:
        raise RuntimeError("the sweeper did not flip the parent")
    return {"latency": claimed - committed, "sweep": after_sweep - committed}


def measure(url: str, children: int = 10_000, repeats: int = 5, batch: int = 500,
            last_batch: int = 50) -> dict[str, Any]:
    """Both paths, ``repeats`` parents each."""
    store = open_store(url, pool_size=2)
    try:
        imm = [immediate_once(store, children, batch, last_batch) for _ in range(repeats)]
        swp = [sweeper_once(store, url, children) for _ in range(repeats)]
    finally:
        store.dispose()
    lat = [r["latency"] for r in imm]
    slat = [r["latency"] for r in swp]
    return {
        "fanin_p95_ms": ms(percentile(lat, 95)),
        "fanin_p50_ms": ms(median(lat)),
        "fanin_last_finish_p50_ms": ms(median([r["last_finish"] for r in imm])),
        "fanin_batch_finish_p50_ms": ms(median([r["batch_median"] for r in imm])),
        "fanin_sweeper_p95_ms": ms(percentile(slat, 95)),
        "fanin_sweeper_p50_ms": ms(median(slat)),
        "fanin_sweep_p50_ms": ms(median([r["sweep"] for r in swp])),
        "fanin_children": children,
        "fanin_repeats": repeats,
        "fanin_batch": batch,
        "fanin_last_batch": last_batch,
    }


def main(children: int = 10_000, repeats: int = 5, batch: int = 500, last_batch: int = 50,
         server: str | None = None) -> dict[str, Any]:
    """Run in a scratch database; print and return the figures."""
    with scratch_database("fanin", server) as url:
        figures = measure(url, children, repeats, batch, last_batch)
    return report(f"fan-in ({children} children; last child's commit -> parent claimed)",
                  figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--last-batch", type=int, default=50)
    a = parser.parse_args()
    main(a.children, a.repeats, a.batch, a.last_batch)
