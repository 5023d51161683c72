"""docs/writing-policies.md: its examples run exactly as written and its tables stay true.

Each example is the fenced block after an ``<!-- example: NAME -->`` marker. The rule
module is written to a temporary directory as is, imported through ``[policies]
modules`` by ``load_policy_set``, and must catch a bad result and pass a good one.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from agents.base import TaskView
from agents.registry import Registry
from policies import base
from policies.loader import PolicySet, load_policy_set
from runtime.config import PoliciesSettings, Settings, load_settings
from runtime.engine.judge_stage import judge_task

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-policies.md"
RULE = "no_competitor_names"


def example(name: str) -> str:
    """The fenced code block right after ``<!-- example: name -->``, exactly as written."""
    text = DOC.read_text(encoding="utf-8")
    found = re.search(rf"<!-- example: {re.escape(name)} -->\n```[a-z]*\n(.*?)\n```", text,
                      re.DOTALL)
    assert found, f"no example {name!r} in {DOC}"
    return found.group(1) + "\n"


def view() -> TaskView:
    task_id = uuid.uuid4()
    return TaskView(id=task_id, root_id=task_id, parent_id=None, agent="competitor_scout",
                    type="research", payload={"goal": "pricing in Europe"}, depth=2,
                    priority=5, budget_tokens=1000, budget_seconds=60, budget_usd=Decimal("1"))


@pytest.fixture
def rules_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"my_rules_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(example("my_rules.py"), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MY_RULES_COMPETITORS", raising=False)
    yield name
    base.registry.remove(RULE)
    sys.modules.pop(name, None)


def rules_for(module: str) -> PolicySet:
    settings = Settings(policies=PoliciesSettings(modules=[module]))
    return load_policy_set(settings, Registry())


def test_the_documented_rule_catches_a_competitor_and_passes_a_clean_result(
        rules_module: str) -> None:
    rules = rules_for(rules_module)
    assert RULE in rules
    bad = {"summary": "Prices trail globex by 10%", "sources": ["https://example.org"]}
    violation = rules.validate_output(view(), bad)
    assert violation is not None and violation.rule == RULE
    assert "'globex'" in violation.message
    assert str(violation).startswith(f"policy {RULE}: ")
    good = {"summary": "Prices trail the market leader by 10%", "sources": []}
    assert rules.validate_output(view(), good) is None
    assert rules.validate_output(view(), {"summary": "Globexia is a made-up town"}) is None


def test_the_documented_rule_reads_its_deny_list_from_the_environment(
        rules_module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_RULES_COMPETITORS", "Hooli, Pied Piper")
    rules = rules_for(rules_module)
    assert rules.validate_output(view(), {"text": "Globex"}) is None
    assert rules.validate_output(view(), {"text": "pied piper wins"}) is not None
    row = next(r for r in rules.describe() if r["name"] == RULE)
    assert row["settings"] == {"deny_list": ["Hooli", "Pied Piper"]}
    assert row["source"] == rules_module


def test_the_documented_rule_switches_off_with_an_empty_deny_list(
        rules_module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_RULES_COMPETITORS", "")
    rules = rules_for(rules_module)
    assert RULE not in rules
    row = next(r for r in rules.describe() if r["name"] == RULE)
    assert row["inactive_reason"] == "MY_RULES_COMPETITORS is empty"


def test_the_documented_config_loads_the_module(tmp_path: Path) -> None:
    config = tmp_path / "orgchart.toml"
    config.write_text(example("orgchart.toml"), encoding="utf-8")
    assert load_settings(config, env={}).policies.modules == ["my_rules"]


def test_every_policies_key_and_builtin_rule_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    for key in PoliciesSettings.model_fields:
        assert f"`{key}`" in text, f"[policies] {key} is not documented"
    for row in load_policy_set(Settings(), Registry()).describe():
        assert f"| `{row['name']}`" in text, f"rule {row['name']} is not in the table"


def test_the_documented_criteria_are_valid_and_judge_as_described() -> None:
    from policies.criteria import validate_criteria

    body: dict[str, Any] = json.loads(example("criteria.json"))
    validate_criteria(body["success_criteria"], body["kill_criteria"])
    checks_only = {k: v for k, v in body["success_criteria"].items() if k != "rubric"}
    task = {"result": {"prices": [9.5], "source": "https://example.org/prices"},
            "success_criteria": checks_only, "kill_criteria": body["kill_criteria"],
            "spent_usd": Decimal("0.1"), "spent_tokens": 100, "duration_seconds": 3.0}
    assert judge_task(task, [], None, Settings()).to_status == "done"
    task["result"] = {"prices": [], "source": "ftp://x"}
    assert judge_task(task, [], None, Settings()).to_status == "failed"
    task["spent_usd"] = Decimal("0.52")
    judgement = judge_task(task, [], None, Settings())
    assert judgement.to_status == "escalated"
    assert "max_cost_usd: spent $0.52 > limit $0.5" in (judgement.error or "")
