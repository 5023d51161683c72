"""Policies: the built-in rules, the registry, the loader and ``orgchart policies``."""

from __future__ import annotations

import json
import sys
import textwrap
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import typer
from pydantic import BaseModel, ConfigDict
from typer.testing import CliRunner

from agents.base import Agent, ChildSpec, TaskView
from agents.registry import Registry
from policies import base
from policies.base import DuplicatePolicy, Policy, Violation
from policies.builtin import ForbiddenOutput, payload_bytes
from policies.loader import PolicySet, load_policy_set
from runtime.cli.app import app
from runtime.config import ConfigError, PoliciesSettings, Settings


class BossOut(BaseModel):
    summary: str
    score: float


class Boss(Agent):
    name = "t_boss"
    register = False
    delegates_to = ("t_scout",)
    output_model = BossOut


class Scout(Agent):
    name = "t_scout"
    register = False


class Loner(Agent):
    name = "t_loner"
    register = False


@pytest.fixture
def agents() -> Registry:
    registry = Registry()
    for cls in (Boss, Scout, Loner):
        registry.add(cls)
    return registry


def view(agent: str = "t_boss", depth: int = 0, payload: dict[str, Any] | None = None) -> TaskView:
    task_id = uuid.uuid4()
    return TaskView(id=task_id, root_id=task_id, parent_id=None, agent=agent, type="task",
                    payload=payload if payload is not None else {"goal": "map the market"},
                    depth=depth, priority=5, budget_tokens=1000, budget_seconds=60,
                    budget_usd=Decimal("1"))


def child(agent: str = "t_scout", key: str = "c1", payload: dict[str, Any] | None = None
          ) -> ChildSpec:
    return ChildSpec(agent=agent, payload=payload or {"goal": "look"}, key=key)


def make_settings(**policies: Any) -> Settings:
    return Settings(policies=PoliciesSettings(**policies))


def policy_set(agents: Registry, **policies: Any) -> PolicySet:
    return load_policy_set(make_settings(**policies), agents)


# ---------------------------------------------------------------------- base
def test_violation_reads_as_policy_rule_and_message() -> None:
    assert str(Violation("max_depth", "too deep")) == "policy max_depth: too deep"


def test_subclassing_with_a_name_registers_and_a_duplicate_names_both_classes() -> None:
    class FirstRule(Policy):
        name = "t_dup_rule"

    try:
        assert base.registry.get("t_dup_rule") is FirstRule
        with pytest.raises(DuplicatePolicy) as info:
            class SecondRule(Policy):
                name = "t_dup_rule"
        assert "FirstRule" in str(info.value) and "SecondRule" in str(info.value)
    finally:
        base.registry.remove("t_dup_rule")


def test_a_rule_is_asked_only_for_the_checks_it_has(agents: Registry) -> None:
    asked: list[str] = []

    class OutputOnly(Policy):
        register = False
        name = "t_output_only"

        def validate_output(self, task: TaskView, result: Any) -> Violation | None:
            asked.append("output")
            return Violation(self.name, "no") if result == {"bad": True} else None

    rule = OutputOnly(make_settings())
    rules = PolicySet([rule])
    assert rules.validate_input(view()) is None  # the rule has no input check: not asked
    assert rules.validate_output(view(), {"bad": True}) == Violation("t_output_only", "no")
    assert asked == ["output"]
    # A check set on the rule itself is asked too, and a changed list of rules is seen.
    rule.validate_input = lambda task: Violation("t_output_only", "input")  # type: ignore[method-assign]
    rules.policies.append(OutputOnly(make_settings()))
    assert rules.validate_input(view()) == Violation("t_output_only", "input")
    asked.clear()
    assert rules.validate_output(view(), {"good": True}) is None
    assert asked == ["output", "output"]


def test_register_false_keeps_an_abstract_rule_out_of_the_registry() -> None:
    class Abstract(Policy):
        name = "t_abstract"
        register = False

    assert "t_abstract" not in base.registry


# ---------------------------------------------------------------------- built-in rules
def test_max_depth_refuses_a_task_deeper_than_the_limit(agents: Registry) -> None:
    rules = policy_set(agents, max_depth=2)
    assert rules.validate_input(view(depth=2)) is None
    violation = rules.validate_input(view(depth=3))
    assert violation is not None and violation.rule == "max_depth"
    assert "depth 3 exceeds max_depth 2" in violation.message


def test_max_depth_refuses_children_beyond_the_limit_so_the_parent_escalates(
        agents: Registry) -> None:
    rules = policy_set(agents, max_depth=1)
    assert rules.validate_delegation(view(depth=0), [child()]) is None
    violation = rules.validate_delegation(view(depth=1), [child()])
    assert violation is not None and violation.rule == "max_depth"
    assert "depth 2" in violation.message


def test_max_children_counts_one_delegation(agents: Registry) -> None:
    rules = policy_set(agents, max_children=2)
    assert rules.validate_delegation(view(), [child(key="a"), child(key="b")]) is None
    violation = rules.validate_delegation(view(), [child(key=k) for k in "abc"])
    assert violation is not None and violation.rule == "max_children"
    assert "3 children" in violation.message and "max_children is 2" in violation.message


def test_max_payload_bytes_checks_the_task_and_each_child(agents: Registry) -> None:
    rules = policy_set(agents, max_payload_bytes=100)
    small, big = {"goal": "x"}, {"goal": "x" * 200}
    assert payload_bytes(big) > 100 >= payload_bytes(small)
    assert rules.validate_input(view(payload=small)) is None
    violation = rules.validate_input(view(payload=big))
    assert violation is not None and violation.rule == "max_payload_bytes"
    violation = rules.validate_delegation(view(), [child(key="ok"), child(key="fat", payload=big)])
    assert violation is not None and "'fat'" in violation.message


def test_payload_bytes_counts_utf8_bytes_not_characters() -> None:
    assert payload_bytes({"g": "é"}) == len('{"g":"é"}'.encode())


def test_delegation_edges_allow_only_the_org_chart(agents: Registry) -> None:
    rules = policy_set(agents)
    assert rules.validate_delegation(view("t_boss"), [child("t_scout")]) is None
    violation = rules.validate_delegation(view("t_boss"), [child("t_scout"),
                                                           child("t_loner", key="x")])
    assert violation is not None and violation.rule == "delegation_edges"
    assert "'t_boss' may not delegate to 't_loner'" in violation.message
    assert "t_scout" in violation.message
    violation = rules.validate_delegation(view("t_loner"), [child("t_scout")])
    assert violation is not None and "delegates_to: nobody" in violation.message


def test_delegation_edges_can_be_switched_off(agents: Registry) -> None:
    rules = policy_set(agents, delegation_edges=False)
    assert "delegation_edges" not in rules
    assert rules.validate_delegation(view("t_loner"), [child("t_boss")]) is None


SECRETS = [
    ("contact jane.doe@example.com today", "an e-mail address"),
    ("key sk-" + "A1b2" * 6, "an API key"),
    ("AKIA" + "ABCDEFGHIJKLMNOP", "an AWS access key"),
    ("ghp_" + "x" * 36, "a GitHub token"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIE", "a private key"),
]


@pytest.mark.parametrize(("secret", "kind"), SECRETS)
def test_forbidden_output_names_the_kind_and_never_echoes_the_secret(
        agents: Registry, secret: str, kind: str) -> None:
    rules = policy_set(agents)
    result = {"summary": "fine", "notes": ["ok", {"detail": secret}]}
    violation = rules.validate_output(view("t_scout"), result)
    assert violation is not None and violation.rule == "forbidden_output"
    assert kind in violation.message
    assert "$.notes[1].detail" in violation.message
    for word in secret.split():
        if len(word) > 6:
            assert word not in str(violation)


def test_forbidden_output_lets_clean_results_through(agents: Registry) -> None:
    rules = policy_set(agents)
    assert rules.validate_output(view("t_scout"), {"text": "Acme sells at example.com"}) is None


def test_forbidden_output_uses_configured_patterns(agents: Registry) -> None:
    rules = policy_set(agents, forbidden_patterns=[r"(?i)confidential"])
    violation = rules.validate_output(view("t_scout"), {"text": "CONFIDENTIAL memo"})
    assert violation is not None and "forbidden pattern 1" in violation.message
    assert rules.validate_output(view("t_scout"), {"text": "me@example.com"}) is None


def test_forbidden_output_is_off_without_patterns(agents: Registry) -> None:
    rules = policy_set(agents, forbidden_patterns=[])
    assert "forbidden_output" not in rules
    row = next(r for r in rules.describe() if r["name"] == "forbidden_output")
    assert row["active"] is False and "no forbidden_patterns" in row["inactive_reason"]


def test_a_bad_forbidden_pattern_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"pattern 2 \('\(unclosed'\)"):
        ForbiddenOutput(make_settings(forbidden_patterns=["ok", "(unclosed"]))


def test_output_schema_checks_the_agents_output_model(agents: Registry) -> None:
    rules = policy_set(agents)
    assert rules.validate_output(view("t_boss"), {"summary": "s", "score": 0.5}) is None
    violation = rules.validate_output(view("t_boss"), {"summary": 3})
    assert violation is not None and violation.rule == "output_schema"
    assert "'t_boss'" in violation.message
    assert "$.summary: 3 is not of type 'string'" in violation.message
    assert "'score' is a required property" in violation.message


def test_output_schema_accepts_a_pydantic_result(agents: Registry) -> None:
    rules = policy_set(agents)
    assert rules.validate_output(view("t_boss"), BossOut(summary="s", score=1)) is None


class AnyObject(BaseModel):
    model_config = ConfigDict(extra="allow")


class Free(Agent):
    name = "t_free"
    register = False
    output_model = AnyObject


def test_output_schema_any_object_is_checked_by_type_alone(agents: Registry) -> None:
    # A model with no field that allows extra ones matches every object: no jsonschema
    # walk per result, and anything but an object is still refused, as the schema says.
    agents.add(Free)
    rules = policy_set(agents)
    assert rules.validate_output(view("t_free"), {"anything": [1, {"x": None}]}) is None
    assert rules.validate_output(view("t_free"), {}) is None
    for bad in ([1, 2], "text", 3, None):
        violation = rules.validate_output(view("t_free"), bad)
        assert violation is not None and violation.rule == "output_schema"
        assert "is not of type 'object'" in violation.message


def test_output_schema_can_be_switched_off(agents: Registry) -> None:
    rules = policy_set(agents, output_schema=False)
    assert rules.validate_output(view("t_boss"), {"summary": 3}) is None


# ---------------------------------------------------------------------- loader
def test_every_builtin_rule_is_described_in_order(agents: Registry) -> None:
    rows = policy_set(agents).describe()
    assert [r["name"] for r in rows] == [
        "max_depth", "max_children", "max_payload_bytes", "delegation_edges",
        "forbidden_output", "output_schema", "model_price", "require_approval", "allowed_tools",
    ]
    assert all(r["source"] == "builtin" for r in rows)
    # require_approval holds nothing until an agent or a spend threshold is configured;
    # allowed_tools restricts nothing until an agent is listed.
    assert [r["name"] for r in rows if not r["active"]] == ["require_approval",
                                                             "allowed_tools"]
    by_name = {r["name"]: r for r in rows}
    assert by_name["max_depth"]["settings"] == {"max_depth": 5}
    assert by_name["model_price"]["settings"]["local_per_token"] == "0.00001"


def test_disabled_removes_a_rule_by_name(agents: Registry) -> None:
    rules = policy_set(agents, disabled=["max_depth"], max_depth=0)
    assert "max_depth" not in rules
    assert rules.validate_input(view(depth=9)) is None
    row = next(r for r in rules.describe() if r["name"] == "max_depth")
    assert row["active"] is False


def test_an_unknown_disabled_name_suggests_the_closest(agents: Registry) -> None:
    with pytest.raises(ConfigError, match="unknown policy rule 'max_dept'; did you mean "
                                          "'max_depth'"):
        policy_set(agents, disabled=["max_dept"])


def test_model_price_cannot_be_disabled(agents: Registry) -> None:
    with pytest.raises(ConfigError, match="'model_price' cannot be disabled"):
        policy_set(agents, disabled=["model_price"])


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"t_rules_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        from policies import Policy, Violation

        class NoTodo(Policy):
            name = "no_todo"
            description = "Results may not say TODO."

            def validate_output(self, task, result):
                if "TODO" in str(result):
                    return Violation(self.name, "the result is unfinished")
                return None

        class Exploding(Policy):
            name = "exploding"

            def validate_input(self, task):
                raise RuntimeError("boom")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    base.registry.remove("no_todo")
    base.registry.remove("exploding")
    sys.modules.pop(name, None)


def test_user_rules_load_from_policies_modules_and_run_after_builtins(
        agents: Registry, user_module: str) -> None:
    rules = policy_set(agents, modules=[user_module], disabled=["exploding"])
    assert rules.names()[-1] == "no_todo"
    violation = rules.validate_output(view("t_scout"), {"text": "TODO: write it"})
    assert violation == Violation("no_todo", "the result is unfinished")
    assert rules.validate_output(view("t_scout"), {"text": "done"}) is None
    row = next(r for r in rules.describe() if r["name"] == "no_todo")
    assert row["source"] == user_module and row["description"] == "Results may not say TODO."


def test_user_rules_are_not_active_unless_their_module_is_listed(
        agents: Registry, user_module: str) -> None:
    __import__(user_module)
    assert "no_todo" in base.registry
    rules = policy_set(agents)
    assert "no_todo" not in rules
    assert all(r["name"] != "no_todo" for r in rules.describe())


def test_a_rule_that_raises_fails_closed(agents: Registry, user_module: str) -> None:
    rules = policy_set(agents, modules=[user_module])
    violation = rules.validate_input(view())
    assert violation is not None and violation.rule == "exploding"
    assert "RuntimeError: boom" in violation.message


def test_a_module_that_cannot_be_imported_is_a_config_error(agents: Registry) -> None:
    with pytest.raises(ConfigError, match="cannot import 'no_such_rules_module'"):
        policy_set(agents, modules=["no_such_rules_module"])


def test_first_violation_wins_in_rule_order(agents: Registry) -> None:
    rules = policy_set(agents, max_depth=0, max_children=1)
    violation = rules.validate_delegation(view(depth=0), [child(key="a"), child(key="b")])
    assert violation is not None and violation.rule == "max_depth"


# ---------------------------------------------------------------------- CLI
@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> typer.Typer:
    for key in [k for k in __import__("os").environ if k.startswith("ORGCHART_")]:
        monkeypatch.delenv(key)
    config = tmp_path / "orgchart.toml"
    config.write_text("[policies]\nmax_depth = 3\n")
    monkeypatch.setenv("ORGCHART_CONFIG", str(config))
    return app


def test_policies_json_lists_rules_with_their_settings(cli: typer.Typer) -> None:
    outcome = CliRunner().invoke(cli, ["policies", "--json"])
    assert outcome.exit_code == 0, outcome.output
    rows = json.loads(outcome.stdout)
    by_name = {r["name"]: r for r in rows}
    assert by_name["max_depth"]["settings"] == {"max_depth": 3}
    assert by_name["model_price"]["active"] is True


def test_policies_table_shows_patterns_verbatim(cli: typer.Typer) -> None:
    outcome = CliRunner().invoke(cli, ["policies"], env={"COLUMNS": "200"})
    assert outcome.exit_code == 0, outcome.output
    assert "max_payload_bytes" in outcome.stdout
    assert r"gh[pousr]_" in outcome.stdout


def test_policies_refuses_an_unknown_disabled_rule(cli: typer.Typer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORGCHART_POLICIES__DISABLED", "outputschema")
    outcome = CliRunner().invoke(cli, ["policies"], env={"COLUMNS": "200"})
    assert outcome.exit_code == 2
    assert "[policies] disabled" in outcome.output
    assert "did you mean 'output_schema'" in outcome.output


def test_allowed_tools_refuses_a_tool_not_named_for_a_listed_agent(agents: Registry) -> None:
    rules = policy_set(agents, allowed_tools={"t_boss": ["search"]})
    assert rules.validate_tool(view("t_boss"), "search") is None
    refused = rules.validate_tool(view("t_boss"), "delete_everything")
    assert refused is not None and refused.rule == "allowed_tools"
    assert "may not call tool 'delete_everything' (allowed: search)" in str(refused)
    assert rules.validate_tool(view("t_worker"), "delete_everything") is None


def test_the_store_holds_for_approval_only_what_an_active_rule_names() -> None:
    from policies.approval import holds

    assert holds(make_settings()) == ((), None)  # unconfigured: off
    on = make_settings(require_approval=["ceo"], approve_above_usd="2.5")
    assert holds(on) == (("ceo",), Decimal("2.5"))
    off = make_settings(require_approval=["ceo"], disabled=["require_approval"])
    assert holds(off) == ((), None)  # named in [policies] disabled: held nowhere
