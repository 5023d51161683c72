"""Every benchmark runs end to end at a toy size and returns its figures (no timing checks)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import sqlalchemy as sa

from bench import (
    charge,
    claim_latency,
    drain,
    drain_pair,
    drain_parts,
    fanin,
    makespan,
    pgqueuer_drain,
    pickup,
    reference,
    run_all,
    schedules,
    tree_read,
    worker_memory,
)
from bench.common import percentile


def _numbers(figures: dict[str, Any], *keys: str) -> None:
    for key in keys:
        assert key in figures, f"missing {key}"
        value = figures[key]
        assert isinstance(value, int | float) and math.isfinite(value) and value >= 0, (key, value)


def _database_exists(server_url: str, name: str) -> bool:
    engine = sa.create_engine(server_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"),
                             {"n": name}).first()
    engine.dispose()
    return found is not None


def test_reference(server_url: str) -> None:
    figures = reference.main(n=200, threads=4, batch=50, server=server_url)
    _numbers(figures, "reference_tasks_per_s", "reference_batched_tasks_per_s",
             "reference_client_cpu_ms_per_task")
    assert figures["reference_tasks"] == 200


def test_pgqueuer_drain(server_url: str) -> None:
    figures = pgqueuer_drain.main(n=200, sweep_n=100, grid=("1x2x10",), server=server_url)
    _numbers(figures, "pgqueuer_jobs_per_s", "pgqueuer_cpu_ms_per_job")
    assert figures["n"] == figures["pgqueuer_jobs"] == 200


def test_drain(server_url: str) -> None:
    figures = drain.main(n=200, sweep_n=50, grid=("1xdefault", "1x4x20"), server=server_url)
    _numbers(figures, "drain_tasks_per_s", "drain_seconds", "drain_tasks_per_s_after_startup",
             "drain_worker_peak_rss_mb", "drain_defaults_tasks_per_s")
    assert figures["drain_events_per_task"] == drain.EVENTS_PER_TASK == 3
    # The defaults drain the full queue too (the figure set beside pgqueuer's best).
    assert figures["drain_defaults_tasks"] == 200
    assert figures["drain_defaults_events_per_task"] == 3
    _numbers(figures, "drain_worker_cpu_ms_per_task", "drain_defaults_worker_cpu_ms_per_task")
    assert figures["drain_postgres_cpu_ms_per_task"] is None or \
        figures["drain_postgres_cpu_ms_per_task"] >= 0  # None: the server is not on this machine
    assert len(figures["drain_sweep"]) == 2
    assert set(figures["drain_settings"]) == {"processes", "sync_threads", "batch_size"}


def test_drain_pair(server_url: str) -> None:
    figures = drain_pair.main(n=100, rounds=2, pgqueuer="1x2x10", server=server_url)
    assert len(figures["drain_pair_rounds"]) == 2
    for r in figures["drain_pair_rounds"]:
        _numbers(r, "orgchart_tasks_per_s", "orgchart_async_tasks_per_s", "pgqueuer_jobs_per_s",
                 "ratio", "async_ratio")
        assert r["ratio"] == round(r["orgchart_tasks_per_s"] / r["pgqueuer_jobs_per_s"], 3)
        assert r["async_ratio"] == round(
            r["orgchart_async_tasks_per_s"] / r["pgqueuer_jobs_per_s"], 3)
    for key in ("ratio", "async_ratio"):
        ratios = sorted(r[key] for r in figures["drain_pair_rounds"])
        median = figures[f"drain_pair_{key}_median"]
        assert median == round((ratios[0] + ratios[1]) / 2, 4)
    with pytest.raises(ValueError, match="pgqueuer setting"):
        drain_pair.main(n=10, rounds=1, pgqueuer="fast", server=server_url)


def test_drain_parts(server_url: str) -> None:
    figures = drain_parts.main(n=150, batch=40, server=server_url)
    assert figures["drain_parts_tasks"] == 150  # every task claimed, executed and done
    parts = figures["drain_parts_cpu_us_per_task"]
    _numbers(parts, "claim", "execute", "finish", "total")
    assert parts["total"] == pytest.approx(parts["claim"] + parts["execute"] + parts["finish"],
                                           abs=0.2)


def test_defaults_against_pgqueuer_only_on_the_same_queue() -> None:
    out = {"drain_defaults_tasks_per_s": 3000.0, "drain_defaults_tasks": 20_000,
           "drain_defaults_worker_cpu_ms_per_task": 0.2,
           "drain_defaults_postgres_cpu_ms_per_task": 0.1,
           "pgqueuer_jobs_per_s": 6000.0, "pgqueuer_jobs": 20_000,
           "pgqueuer_cpu_ms_per_job": 0.14, "pgqueuer_postgres_cpu_ms_per_job": None}
    figures = run_all.defaults_vs_pgqueuer(out)
    assert figures["drain_defaults_vs_pgqueuer"] == 0.5
    cpu = figures["drain_defaults_vs_pgqueuer_cpu_ms_per_task"]
    assert cpu["orgchart_total"] == 0.3 and cpu["pgqueuer_total"] is None
    with pytest.raises(RuntimeError, match="not comparable"):
        run_all.defaults_vs_pgqueuer({**out, "pgqueuer_jobs": 10_000})
    assert run_all.defaults_vs_pgqueuer({"pgqueuer_jobs_per_s": 1.0}) == {}


def test_drain_setting_errors() -> None:
    assert str(drain.Setting.parse("2x32x100")) == "2x32x100"
    with pytest.raises(ValueError, match="PROCSxTHREADSxBATCH"):
        drain.Setting.parse("2x32")
    with pytest.raises(ValueError, match="at least 1"):
        drain.Setting.parse("0x32x100")


def test_pickup(server_url: str) -> None:
    figures = pickup.main(samples=3, server=server_url)
    _numbers(figures, "pickup_p50_ms", "pickup_p95_ms", "pickup_max_ms")


def test_fanin(server_url: str) -> None:
    figures = fanin.main(children=120, repeats=2, batch=50, last_batch=10, server=server_url)
    _numbers(figures, "fanin_p95_ms", "fanin_p50_ms", "fanin_sweeper_p95_ms",
             "fanin_sweep_p50_ms", "fanin_last_finish_p50_ms")
    assert figures["fanin_children"] == 120


def test_claim_latency(server_url: str) -> None:
    figures = claim_latency.main(pending=100, finished=1_000, samples=10, deep=300,
                                 server=server_url)
    _numbers(figures, "claim_ms_small_table", "claim_ms_1m_finished", "claim_ms_20k_pending")
    assert "ix_tasks_claimable" in figures["claim_plan_1m"]


def test_tree_read(server_url: str) -> None:
    figures = tree_read.main(nodes=200, repeats=2, server=server_url)
    _numbers(figures, "tree_ms_10k", "tree_read_rows_ms", "tree_nest_ms")
    assert figures["tree_nodes"] == 200


def test_scrape(server_url: str) -> None:
    from bench import scrape

    figures = scrape.main(finished=2_000, repeats=2, server=server_url)
    _numbers(figures, "scrape_ms_1m_finished", "scrape_bytes", "metrics_json_ms_1m_finished")
    assert figures["scrape_finished_rows"] == 2_000 and figures["scrape_bytes"] > 1000


def test_tree_count_is_exact(server_url: str) -> None:
    figures = tree_read.main(nodes=60, repeats=1, server=server_url)  # 1 + 7 + 7 * 7 + 3
    assert figures["tree_nodes"] == 60


def test_worker_memory(server_url: str) -> None:
    figures = worker_memory.main(n=200, sync_threads=8, batch_size=50, server=server_url)
    _numbers(figures, "worker_peak_rss_mb", "worker_rss_at_end_mb")
    assert figures["worker_peak_rss_mb"] > 0


def test_run_all_writes_json(server_url: str, tmp_path: Any,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORGCHART_DATABASE_URL", server_url)
    out = tmp_path / "latest.json"
    result = run_all.main(["--quick", "--only", "drain,reference", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == result
    assert saved["machine"]["nproc"] >= 1 and saved["machine"]["postgresql"]
    assert saved["ts"] and saved["quick"] is True
    _numbers(saved, "reference_tasks_per_s", "reference_after_drain_tasks_per_s",
             "drain_tasks_per_s", "drain_vs_reference", "drain_after_startup_vs_reference")
    assert set(saved["durations_s"]) == {"reference", "drain"}
    assert "tree_ms_10k" not in saved  # only what was asked ran


def test_run_all_rejects_unknown_names(server_url: str) -> None:
    with pytest.raises(ValueError, match="unknown benchmark 'drian'"):
        run_all.run(("drian",), quick=True, server=server_url)


def test_server_cpu_is_read_for_a_local_server(server_url: str) -> None:
    from bench.common import server_cpu_seconds

    host = sa.engine.make_url(server_url).host
    seconds = server_cpu_seconds(server_url)
    if host in (None, "", "localhost", "127.0.0.1", "::1"):  # a server on this machine
        assert seconds is not None and seconds > 0
    else:
        assert seconds is None or seconds > 0


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 95) == 5
    assert percentile([0, 10], 95) == pytest.approx(9.5)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_scratch_database_is_dropped_on_error(server_url: str) -> None:
    from bench.common import scratch_database

    names = []
    with pytest.raises(RuntimeError, match="boom"), scratch_database("smoke", server_url) as url:
        names.append(sa.engine.make_url(url).database)
        assert _database_exists(server_url, names[0])
        raise RuntimeError("boom")
    assert names[0].startswith("bench_smoke_")
    assert not _database_exists(server_url, names[0])


def test_makespan(server_url: str) -> None:
    figures = makespan.main(leads=2, writers=3, delay=0.1, server=server_url)
    _numbers(figures, "makespan_seconds", "makespan_vs_critical_path", "peak_calls_in_flight")
    assert figures["makespan_tasks"] == 9 and figures["makespan_model_calls"] == 7
    assert figures["peak_calls_in_flight"] >= 1
    # The floor makes the tree's calls (6 at once, then 1) without the engine: two calls of
    # 0.1 s one after the other cannot take less than the critical path.
    for client in ("official", "bare"):
        _numbers(figures, f"makespan_floor_{client}_seconds",
                 f"makespan_floor_{client}_cpu_ms_per_call")
        assert figures[f"makespan_floor_{client}_seconds"] >= 0.2
    assert math.isfinite(figures["makespan_above_floor_seconds"])


def test_charge(server_url: str) -> None:
    figures = charge.main(leaves=20, threads=4, charges=40, server=server_url,
                          calls_per_leaf=2)
    _numbers(figures, "charge_p50_ms", "charge_p99_ms", "charge_direct_p99_ms",
             "charge_loop_p99_ms")
    assert figures["charge_count"] == 40 and figures["charge_live_tree_calls"] == 40
    assert figures["charge_loop_count"] == 40  # 20 leaves x 2 calls, every one charged
    assert figures["charge_root_spent_tokens_while_running"] == 0


def test_transport() -> None:
    from bench import transport

    figures = transport.main(calls=10, seq=5, rounds=1, delay=0.01)
    for kind in ("httpx", "lean"):
        _numbers(figures, f"transport_{kind}_burst_cpu_ms_per_call",
                 f"transport_{kind}_sequential_p50_ms", f"transport_{kind}_sequential_p99_ms")


def test_fork(server_url: str) -> None:
    from bench import fork

    figures = fork.main(leads=2, writers=3, delay=0.05, server=server_url)
    _numbers(figures, "rerun_makespan_seconds", "noop_makespan_seconds", "rerun_vs_noop")
    # counted at the model server: the forked writer and the aggregate that quotes it
    assert (figures["fork_paid_calls"], figures["fork_replayed_calls"]) == (2, 2)
    assert figures["rerun_tree_tasks"] == 9
    # the 9-task tree makes 7 calls a run: every one replayed, in every round
    assert figures["rerun_rounds"] >= 1
    assert (figures["rerun_paid_calls"], figures["rerun_replayed_calls"]) == (
        0, 7 * figures["rerun_rounds"])


def test_tools(server_url: str) -> None:
    from bench import tools

    figures = tools.main(samples=2, rounds=2, crash=False, server=server_url)
    _numbers(figures, "tool_round_overhead_ms_p50", "tool_round_overhead_ms_p90",
             "model_call_ms_p50", "loop_ms_p50")
    assert figures["rounds_per_sample"] == 2


def test_fairness(server_url: str) -> None:
    from bench import fairness

    figures = fairness.main(wide=90, delay=0.05, window=3.0, share_writers=900,
                            limit_writers=20, server=server_url)
    _numbers(figures, "fair_small_tree_ratio", "fair_share_error", "tenant_limit_overrun",
             "tenant_tokens_per_minute_overrun", "tenant_tokens_per_minute_measured",
             "fair_cost_share_error")
    assert figures["tenant_limit_tree_status"] == "done"
    assert figures["tenant_limit_peak_running"] <= 10


def test_schedules(server_url: str) -> None:
    figures = schedules.main(seconds=4, kill_every=2, workers=1, server=server_url)
    _numbers(figures, "schedule_slots_expected", "schedule_slots_fired",
             "schedule_latency_p50_ms", "schedule_kills")
    assert figures["schedule_slots_twice"] == figures["schedule_slots_unaccounted"] == 0
    assert figures["schedule_roots_per_fired_slot"] == 1
