"""``stamped`` rebuilds a run outcome field by field (for speed): no field may be lost."""

from __future__ import annotations

import dataclasses
import uuid
from types import SimpleNamespace
from typing import Any

from runtime.engine.started import stamped
from runtime.store.rows import RunOutcome

#: A value other than the default for every field of RunOutcome but the stamp. A field
#: added to RunOutcome fails the first assertion until it is given one here (and, in
#: ``stamped``, carried over).
NOT_DEFAULT: dict[str, Any] = {
    "task_id": uuid.uuid4(), "lease_token": uuid.uuid4(), "to_status": "done",
    "result": {"a": 1}, "error": "an error", "delay_seconds": 2.5, "detail": "a detail",
    "verdict": {"passed": True}, "skips_judging": True,
}


def test_stamped_keeps_every_field_of_a_run_outcome() -> None:
    names = {f.name for f in dataclasses.fields(RunOutcome)} - {"stamp"}
    assert names == set(NOT_DEFAULT)
    started: Any = SimpleNamespace(cls=SimpleNamespace(version="v7"),
                                   ctx=SimpleNamespace(prompt_hashes={"p": "h"}), llm=None)
    out = stamped(started, RunOutcome(**NOT_DEFAULT))
    assert isinstance(out, RunOutcome)
    assert {n: getattr(out, n) for n in names} == NOT_DEFAULT
    assert out.stamp == {"version": "v7", "prompts": {"p": "h"}, "replays": []}
