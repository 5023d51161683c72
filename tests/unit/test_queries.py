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


#: The statements a worker sends for every batch of tasks (claims, outcomes, leases,
#: model-call charges and the gate).
HOT = ("task_claim_available", "task_claim_capped", "task_claim_judging", "task_finish_running",
       "task_finish_judging", "task_heartbeat_leased", "task_charge_running_many",
       "task_gate_calls")


def test_the_statements_of_every_batch_fit_psycopgs_query_cache() -> None:
    import psycopg._queries  # third-party private: the cache limit has no public name
    from sqlalchemy.dialects import postgresql

    from runtime.store.queries import MAX_SENT_CHARS, TEXT

    # Longer queries are converted again, by regular expression, at every execution.
    assert psycopg._queries.MAX_CACHED_STATEMENT_LENGTH == MAX_SENT_CHARS
    dialect = postgresql.psycopg.dialect()  # type: ignore[attr-defined]
    for name in HOT:
        sent = str(TEXT[name].compile(dialect=dialect))
        assert len(sent) <= MAX_SENT_CHARS, (name, len(sent))


def test_a_statement_is_sent_with_its_description_and_no_other_comment_line() -> None:
    for name, sql in QUERIES.items():
        if name.startswith("fragment_"):
            continue
        lines = sql.splitlines()
        assert lines[0].startswith("-- "), name  # pg_stat_statements shows which ran
        assert not any(line.lstrip().startswith("--") for line in lines[1:]), name
