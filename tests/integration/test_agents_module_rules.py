"""A rule defined in the module given to ``--agents-module`` is on (issue 45, item 1).

The option's help says it imports "agents (and policies)". A user writes one module
holding an agent and the rule that stops its over-promising results; the result must end
``escalated`` by that rule, not ``done``; ``orgchart policies --agents-module`` lists the
rule as active, and ``[policies] disabled`` still switches it off by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from policies import base
from runtime.wiring import Runtime
from tests.factories import submit
from tests.support import drain

REPO = Path(__file__).resolve().parents[2]
RULE = "no_guarantees"
AGENT = "t_promiser"

MODULE = textwrap.dedent(f'''
    from pydantic import BaseModel, ConfigDict

    from agents.base import Agent, Result
    from policies import Policy, Violation


    class Anything(BaseModel):
        model_config = ConfigDict(extra="allow")
        goal: str = ""


    class Promiser(Agent):
        name = "{AGENT}"
        input_model = Anything
        output_model = Anything

        def run(self, ctx, task):
            return Result({{"text": "We guarantee 100% uptime, forever."}})


    class NoGuarantees(Policy):
        name = "{RULE}"
        description = "A result may not promise what nobody can keep."

        def validate_output(self, task, result):
            if "guarantee" in str(result).lower():
                return Violation(self.name, "the result over-promises")
            return None
''')


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module on the path holding an agent and a rule, as a user writes it."""
    name = f"t_user_org_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    from agents.registry import registry as agents

    base.registry.remove(RULE)
    agents.remove(AGENT)
    sys.modules.pop(name, None)


def test_an_over_promising_result_is_escalated_by_the_modules_rule(
        make_runtime: Callable[..., Runtime], user_module: str) -> None:
    runtime = make_runtime(modules=[user_module])
    assert RULE in runtime.policies.names()
    root = submit(runtime.store, AGENT, {"goal": "how reliable is it?"})
    drain(runtime)
    task = runtime.store.reads.get(root["id"])
    assert task["status"] == "escalated", task
    assert task["error"] == f"policy {RULE}: the result over-promises"


def test_disabled_still_switches_the_modules_rule_off(
        make_runtime: Callable[..., Runtime], user_module: str) -> None:
    runtime = make_runtime(modules=[user_module], ORGCHART_POLICIES__DISABLED=RULE)
    assert RULE not in runtime.policies.names()
    root = submit(runtime.store, AGENT, {"goal": "how reliable is it?"})
    drain(runtime)
    assert runtime.store.reads.get(root["id"])["status"] == "done"


def on_path(env: dict[str, str], where: Path) -> dict[str, str]:
    """``env`` with the user's module and this checkout first on the path."""
    return {**env, "PYTHONPATH": f"{where}{os.pathsep}{REPO}"}


def policies_json(env: dict[str, str], cwd: Path, *extra: str) -> list[dict[str, object]]:
    done = subprocess.run([sys.executable, "-m", "runtime.cli.app", "policies", "--json", *extra],
                          env=on_path(env, cwd), cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, object]] = json.loads(done.stdout)
    return rows


def test_policies_lists_the_modules_rule_as_active(orgchart_env: dict[str, str],
                                                   tmp_path: Path) -> None:
    (tmp_path / "my_org.py").write_text(MODULE, encoding="utf-8")
    without = policies_json(orgchart_env, tmp_path)
    assert RULE not in {r["name"] for r in without}
    rows = {r["name"]: r for r in policies_json(orgchart_env, tmp_path,
                                                 "--agents-module", "my_org")}
    assert rows[RULE]["active"] is True and rows[RULE]["source"] == "my_org"
    off = {r["name"]: r for r in policies_json(
        {**orgchart_env, "ORGCHART_POLICIES__DISABLED": RULE}, tmp_path,
        "--agents-module", "my_org")}
    assert off[RULE]["active"] is False
    assert off[RULE]["inactive_reason"] == "[policies] disabled"


def test_run_with_the_module_ends_the_over_promise_escalated(orgchart_env: dict[str, str],
                                                             tmp_path: Path) -> None:
    # The case as the user met it: `orgchart run ... --agents-module my_org`.
    (tmp_path / "my_org.py").write_text(MODULE, encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "runtime.cli.app", "run", "how reliable?",
                           "--agent", AGENT, "--agents-module", "my_org", "--json"],
                          env=on_path(orgchart_env, tmp_path), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    tree = json.loads(done.stdout)
    assert tree["status"] == "escalated"
    assert tree["error"] == f"policy {RULE}: the result over-promises"
