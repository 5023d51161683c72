"""Which agent methods the worker awaits on its loop: asked per task, kept per class."""

from __future__ import annotations

import uuid

from runtime.config import load_settings
from runtime.store.rows import TaskRow
from runtime.store.store import Store
from runtime.wiring import build_runtime


def _row(agent: str, phase: str = "run") -> TaskRow:
    return TaskRow(id=uuid.uuid4(), root_id=uuid.uuid4(), to_agent=agent, type="work",
                   payload={}, status="running", phase=phase)


def test_the_method_a_phase_needs_decides_and_the_answer_is_kept(db_url: str,
                                                                 store: Store) -> None:
    settings = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                                  "ORGCHART_LLM__BACKEND": "offline"})
    executor = build_runtime(settings, ["tests.support_agents"], store=store).executor()
    asked = {(agent, phase): executor.is_async(_row(agent, phase))
             for agent, phase in [("async_noop", "run"), ("noop", "run"),
                                  ("half_async", "run"), ("half_async", "aggregate"),
                                  ("no_such_agent", "run")]}
    assert asked == {("async_noop", "run"): True, ("noop", "run"): False,
                     ("half_async", "run"): False, ("half_async", "aggregate"): True,
                     ("no_such_agent", "run"): False}
    # Asked again, from what was kept: the same answers.
    assert all(executor.is_async(_row(a, p)) == v for (a, p), v in asked.items())
