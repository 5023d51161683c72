"""A worker process's garbage collection (checked in fresh interpreters: it is global)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json, sys
from runtime.engine.gc_tuning import tune_gc
before = gc.get_threshold()
tune_gc(int(sys.argv[1]))
print(json.dumps({"before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count()}))
"""


def _probe(threshold: int) -> dict[str, list[int] | int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(threshold)], check=True,
                         capture_output=True, text=True).stdout
    result: dict[str, list[int] | int] = json.loads(out)
    return result


def test_tuning_freezes_start_up_and_raises_the_young_threshold() -> None:
    seen = _probe(10_000)
    before, after = seen["before"], seen["after"]
    assert isinstance(before, list) and isinstance(after, list)
    assert after == [10_000, *before[1:]]
    assert isinstance(seen["frozen"], int) and seen["frozen"] > 1_000  # modules and all


def test_a_threshold_of_zero_leaves_the_interpreter_alone() -> None:
    seen = _probe(0)
    assert seen["after"] == seen["before"] and seen["frozen"] == 0
