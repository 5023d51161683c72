"""TaskView.from_row fills the view past the dataclass's __init__: it must build the same."""

from __future__ import annotations

import dataclasses
import uuid
from decimal import Decimal

import pytest

from agents.tasks import DEFAULT_BUDGET_TOKENS, DEFAULT_BUDGET_USD, DEFAULT_PRIORITY, TaskView
from runtime.store.rows import TaskRow


def _row(**columns: object) -> TaskRow:
    base: dict[str, object] = {
        "id": uuid.uuid4(), "root_id": uuid.uuid4(), "to_agent": "noop", "type": "work",
        "payload": {"goal": "g"}, "status": "running"}
    return TaskRow(**{**base, **columns})  # type: ignore[arg-type]


def _by_init(view: TaskView) -> TaskView:
    return TaskView(**{f.name: getattr(view, f.name) for f in dataclasses.fields(TaskView)})


@pytest.mark.parametrize("row", [
    _row(),
    _row(priority=2, budget_usd=Decimal("0.5"), spent_tokens=3, own_usd=Decimal("0.25"),
         phase="aggregate", delivery_count=2, from_agent="ceo", depth=1,
         success_criteria={"rubric": "r"}, kill_criteria={"max_failures": 1},
         result={"ok": True}, parent_id=uuid.uuid4()),
    _row(payload=["not", "an", "object"]),
])
def test_a_view_from_a_row_equals_one_built_by_init(row: TaskRow) -> None:
    view = TaskView.from_row(row, {"goal": "g"})
    assert set(vars(view)) == {f.name for f in dataclasses.fields(TaskView)}
    assert view == _by_init(view)
    assert view.agent == "noop" and view.input == {"goal": "g"}
    assert isinstance(view.payload, dict)


def test_defaults_fill_what_a_mapping_leaves_out_and_the_view_stays_frozen() -> None:
    view = TaskView.from_row({"id": uuid.uuid4(), "root_id": uuid.uuid4(), "to_agent": "noop",
                              "type": "work", "payload": {}, "priority": None})
    assert view.priority == DEFAULT_PRIORITY and view.budget_tokens == DEFAULT_BUDGET_TOKENS
    assert view.budget_usd == Decimal(DEFAULT_BUDGET_USD) and view.attempt == 1
    assert view.phase == "run" and view.parent_id is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.priority = 1  # type: ignore[misc]


def test_a_mapping_without_a_required_column_raises() -> None:
    with pytest.raises(KeyError, match="to_agent"):
        TaskView.from_row({"id": uuid.uuid4(), "root_id": uuid.uuid4(), "type": "work",
                           "payload": {}})
