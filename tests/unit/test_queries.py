"""The named SQL of runtime/store/queries.sql: one statement each, fragments spliced in."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.store.queries import QUERIES, load_queries


def _statements(sql: str) -> list[str]:
    """Split on semicolons outside quotes and comments; drop empty pieces."""
    pieces: list[str] = []
    current: list[str] = []
    quote = ""
    for line in sql.splitlines():
        text = line + "\n"
        for i, ch in enumerate(text):
            if quote:
                current.append(ch)
                if ch == quote:
                    quote = ""
            elif ch == "-" and text[i + 1:i + 2] == "-":
                break  # a comment to the end of the line
            elif ch in "'\"":
                quote = ch
                current.append(ch)
            elif ch == ";":
                pieces.append("".join(current))
                current = []
            else:
                current.append(ch)
    pieces.append("".join(current))
    return [p for p in pieces if p.strip()]


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_every_named_query_is_one_statement(name: str) -> None:
    assert len(_statements(QUERIES[name])) == 1, f"{name} holds more than one statement"


def test_fragments_are_spliced_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    assert "{fragment_" not in QUERIES["task_tree_nodes"]
    assert "concat(" in QUERIES["task_tree_nodes"] and "concat(" in QUERIES["task_subtree_nodes"]
    bad = tmp_path / "queries.sql"
    bad.write_text("-- some_read --\n-- A read.\nSELECT {fragment_missing} FROM tasks;\n")
    with pytest.raises(ValueError, match="unknown fragment"):
        load_queries(bad)
