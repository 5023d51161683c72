"""The history format (runtime/audit/history.py): what the recorder writes, the reader reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.audit.history import Recorder, load


def test_an_operation_is_an_invoke_then_its_outcome(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "h.jsonl", process="client-1")
    with rec.operation("submit", {"idempotency_key": "k"}) as told:
        told["id"] = "00000000-0000-0000-0000-000000000001"
    with rec.operation("answer", {"task": "t"}) as told:
        told.update(outcome="fail", status=409)
    with pytest.raises(TimeoutError), rec.operation("cancel", {"task": "t"}):
        raise TimeoutError("no reply")
    lines = [json.loads(line) for line in rec.path.read_text().splitlines()]
    assert [(x["type"], x["index"]) for x in lines] == [
        ("invoke", 0), ("ok", 0), ("invoke", 1), ("fail", 1), ("invoke", 2), ("info", 2)]
    assert all({"wall", "mono", "process"} <= set(x) for x in lines)
    ops = load(rec.path).operations
    assert [(o.op, o.outcome) for o in ops] == [("submit", "ok"), ("answer", "fail"),
                                                 ("cancel", "info")]
    assert ops[0].value == {"id": "00000000-0000-0000-0000-000000000001"}
    assert ops[1].value == {"status": 409}
    assert "TimeoutError: no reply" in ops[2].value["error"]
    assert all(o.completed is not None and o.completed >= o.invoked for o in ops)


def test_an_operation_never_completed_reads_as_info(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "h.jsonl")
    rec.invoke("pause", {"root": "r"})
    (op,) = load(rec.path).operations
    assert op.outcome == "info" and op.completed is None


def test_faults_and_outside_requests_keep_their_windows(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "h.jsonl")
    rec.fault("kill", "worker-1", start=10.0, end=10.0)
    rec.fault("partition", "host0", start=20.0, end=32.0)
    rec.request("model", "abc", 25.0)
    history = load(rec.path)
    assert [(f.fault, f.start, f.end) for f in history.faults] == [
        ("kill", 10.0, 10.0), ("partition", 20.0, 32.0)]
    assert [f.fault for f in history.faults_between(30.0, 40.0, slack=0.0)] == ["partition"]
    assert [f.fault for f in history.faults_between(11.0, 18.0, slack=1.5)] == ["kill"]
    assert [(r.source, r.key, r.at) for r in history.requests] == [("model", "abc", 25.0)]


def test_a_bad_line_or_name_is_refused(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "h.jsonl")
    with pytest.raises(ValueError, match="unknown operation"):
        rec.invoke("explode", {})
    with pytest.raises(ValueError, match="unknown fault"):
        rec.fault("meteor")
    rec.path.write_text('{"type": "invoke"}\n')
    with pytest.raises(ValueError, match=r"h.jsonl:1: not a history line"):
        load(rec.path)
