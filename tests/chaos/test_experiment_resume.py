"""Chaos: ``orgchart experiment run`` SIGKILLed mid-way resumes to the same report.

Three goals of the seed's org under two variants (docs/examples/experiments), against the
loopback Ollama-compatible server taking 0.2 s a call. The first ``experiment run`` is
SIGKILLed once the server has been asked half the calls a clean run makes; the same
command run again finds the trees already started (none started twice), drains them, runs
the rest, and reports what a clean run of the same experiment reports. No call is paid
twice except those in flight at the kill (asked, and answered or not, but never recorded).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from runtime.audit.history import Recorder
from runtime.store.store import Store
from tests.chaos.helpers import REPO_ROOT, assert_audited, cli, cli_env, record_model_server
from tests.fake_ollama import FakeOllama, fake_ollama_server  # noqa: F401

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

EXAMPLE = Path(REPO_ROOT) / "docs" / "examples" / "experiments"
#: Calls a clean run pays against the loopback server (measured: 21, the forks' included).
CALLS_OF_A_CLEAN_RUN = 21
MAX_PARALLEL = 4


def _command(name: str) -> list[str]:
    return cli("experiment", "run", str(EXAMPLE / "market_goals.jsonl"),
               "--variants", str(EXAMPLE / "variants.toml"),
               "--agents-module", "docs.examples.experiments.scouts_v2",
               "--name", name, "--json", "--timeout", "200")


def _scores(report: dict) -> dict[str, dict[str, float | None]]:
    return {v["name"]: {s: v["scores"][s]["mean"] for s in ("done", "verdict", "expected")}
            for v in report["variants"]}


def test_a_killed_experiment_run_resumes_to_the_same_report(
        store: Store, orgchart_env: dict[str, str], fake_ollama: FakeOllama,
        history: Recorder) -> None:
    fake_ollama.delay_seconds = 0.2
    env = cli_env(orgchart_env, ORGCHART_LLM__BACKEND="ollama",
                  ORGCHART_OLLAMA__URL=fake_ollama.url,
                  ORGCHART_OLLAMA__MAX_PARALLEL=str(MAX_PARALLEL),
                  ORGCHART_OLLAMA__CLOUD_MAX_PARALLEL=str(MAX_PARALLEL),
                  ORGCHART_WORKER__LEASE_SECONDS="2")
    first = subprocess.Popen(_command("killed"), cwd=REPO_ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(fake_ollama.requests) < CALLS_OF_A_CLEAN_RUN // 2:
        assert first.poll() is None, first.stderr.read() if first.stderr else ""
        assert time.monotonic() < deadline, "the model server never saw half the calls"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    history.fault("kill", f"experiment run pid {first.pid}")
    asked_at_kill = len(fake_ollama.requests)

    again = subprocess.run(_command("killed"), cwd=REPO_ROOT, env=env, capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 0, again.stderr
    resumed = json.loads(again.stdout)
    assert "found from before" in again.stderr

    experiment = store.experiments.get("killed")
    assert experiment is not None and experiment["status"] == "finished"
    runs = store.experiments.runs(experiment["id"])
    assert len(runs) == 6 and len({r["root_id"] for r in runs}) == 6
    with store.engine.connect() as conn:
        roots = conn.exec_driver_sql(
            "SELECT count(*) FROM tasks WHERE parent_id IS NULL").scalar()
        paid = conn.exec_driver_sql(
            "SELECT task_id, phase, position, request_hash FROM model_calls "
            "WHERE error IS NULL AND NOT replayed").all()
    assert roots == 6  # no tree was started twice, and none is left without its run row
    recorded = Counter(paid)
    assert max(recorded.values()) == 1, "a recorded call was paid twice"
    # What the server was asked beyond what was recorded: only calls in flight at the kill
    # (at most MAX_PARALLEL on each route's server; both routes are this one server here).
    assert len(fake_ollama.requests) - len(paid) <= 2 * MAX_PARALLEL, (
        len(fake_ollama.requests), len(paid), asked_at_kill)

    record_model_server(history, fake_ollama)
    assert_audited(store, history)  # the promises hold on every tree, the judges' included

    clean = subprocess.run(_command("clean"), cwd=REPO_ROOT, env=env, capture_output=True,
                           text=True, timeout=240)
    assert clean.returncode == 0, clean.stderr
    reference = json.loads(clean.stdout)
    assert _scores(resumed) == _scores(reference)
    assert [v["trees"] for v in resumed["variants"]] == [3, 3]
    print(f"killed after {asked_at_kill} calls asked; resumed: "
          f"{sum(v['paid_calls'] for v in resumed['variants'])} paid, "
          f"{sum(v['replayed_calls'] for v in resumed['variants'])} replayed; server saw "
          f"{len(fake_ollama.requests)} requests in all (a clean run: "
          f"{sum(v['paid_calls'] for v in reference['variants'])} paid)")
