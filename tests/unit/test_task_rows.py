"""TaskRow built from a result's columns, and copied: the generated paths equal the plain ones."""

from __future__ import annotations

import dataclasses
import uuid
from decimal import Decimal

import pytest

from runtime.store.rows import TaskRow

KEYS = ["extra", "id", "to_agent", "type", "payload", "status", "spent_usd", "lease_token",
        "result", "tenant"]


def _values(n: int) -> list[tuple[object, ...]]:
    return [("ignored", uuid.uuid4(), "noop", "work", {"goal": f"g{i}"}, "running",
             Decimal(i), uuid.uuid4(), None, f"t{i}") for i in range(n)]


def test_rows_from_a_result_equal_rows_built_by_init() -> None:
    values = _values(3)
    built = TaskRow.from_rows(KEYS, values)
    again = TaskRow.from_rows(KEYS, values)  # the cached builder
    expected = [TaskRow(**{k: v for k, v in zip(KEYS, row, strict=True) if k != "extra"})
                for row in values]
    assert built == expected == again
    assert built[0].budget_tokens == expected[0].budget_tokens  # a default, not a column
    assert built[2].tenant == "t2" and built[1].spent_usd == Decimal(1)


def test_a_large_result_built_column_by_column_equals_rows_built_by_init() -> None:
    values = _values(40)  # past the size where a result is built column by column
    built = TaskRow.from_rows(KEYS, values)
    expected = [TaskRow(**{k: v for k, v in zip(KEYS, row, strict=True) if k != "extra"})
                for row in values]
    assert built == expected
    assert [r.tenant for r in built[-2:]] == ["t38", "t39"] and built[5].depth == 0


def test_the_source_builds_no_code_at_run_time() -> None:
    import inspect

    from runtime.store import rows

    source = inspect.getsource(rows)
    assert "exec(" not in source and "compile(" not in source


def test_a_result_without_a_required_column_fails_as_init_does() -> None:
    with pytest.raises(TypeError, match="status"):
        TaskRow.from_rows(KEYS[:5], [v[:5] for v in _values(1)])


def test_replace_copies_every_column_and_refuses_unknown_ones() -> None:
    (row,) = TaskRow.from_rows(KEYS, _values(1))
    copy = row.replace(result={"ok": True}, spent_tokens=7)
    assert copy is not row and row.result is None
    assert copy == dataclasses.replace(row, result={"ok": True}, spent_tokens=7)
    with pytest.raises(TypeError, match="nope"):
        row.replace(nope=1)
