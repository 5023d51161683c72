"""docs/configuration.md is generated from runtime/config.py and kept current.

``orgchart config --markdown`` writes it (:func:`runtime.cli.configuration.reference_markdown`).
A setting added or changed without regenerating the file fails here, with the command to run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.cli.app import app
from runtime.cli.configuration import (
    REGENERATE,
    doc_comments,
    meaning,
    reference_markdown,
    reference_sections,
)
from runtime.config import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_reference_is_current() -> None:
    assert DOC.read_text(encoding="utf-8") == reference_markdown(), (
        "docs/configuration.md is stale (a setting in runtime/config.py was added or "
        f"changed): regenerate it with `.venv/bin/{REGENERATE}` and commit it")


def test_every_setting_has_one_line_of_meaning() -> None:
    missing = [f"[{heading}] {key}" for heading, model, _env in reference_sections()
               for key in model.model_fields if not meaning(model, key)]
    assert missing == [], (
        "say what these settings do: a `#:` comment above the key in runtime/config.py "
        f"(or Field(description=...)), then run `.venv/bin/{REGENERATE}`")


def test_every_key_of_the_settings_is_in_the_reference() -> None:
    text = reference_markdown()
    for section, key, _value, _origin in Settings().explain():
        assert f"## `[{section}]`" in text or section == "tenants"
        assert f"| `{key}` |" in text, f"{section}.{key}"


def test_orgchart_config_markdown_prints_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORGCHART_CONFIG", "/nonexistent/orgchart.toml")  # not read at all
    result = CliRunner().invoke(app, ["config", "--markdown"])
    assert result.exit_code == 0, result.output
    assert result.stdout == reference_markdown()


def test_doc_comments_are_read_from_the_lines_above_a_key() -> None:
    from runtime.config import WorkerSettings

    comments = doc_comments(WorkerSettings)
    assert comments["max_in_flight"].startswith("Tasks one worker process holds at once")
    assert "lease_seconds" in comments and "concurrency" not in WorkerSettings.model_fields
