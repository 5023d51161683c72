"""docs/writing-agents.md type-checks: ``ctx.llm.complete(prompt, schema=Plan)`` is a
``Completion[Plan]`` to mypy, and the docs' example code passes it.

The ```python blocks titled ``my_agents.py`` and ``typed_replies.py`` are written to a
temporary directory, with a probe module that asks mypy what the replies are
(``reveal_type``) and makes one assignment that must fail (a ``Completion[HaikuLines]``
is not a ``Completion[str]``: the reply is typed, not ``Any``).
"""

from __future__ import annotations

import re
from pathlib import Path

from mypy import api

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "writing-agents.md"
FENCE = re.compile(r'^```python title="(?P<title>[^"]+)"\n(?P<code>.*?)^```$', re.M | re.S)

PROBE = '''
from agents import Completion
from agents.context import AgentContext
from my_agents import HaikuLines


async def probe(ctx: AgentContext) -> None:
    reveal_type(ctx.llm.complete("a haiku", schema=HaikuLines))
    reveal_type(ctx.llm.complete("a haiku"))
    reveal_type((await ctx.llm.acomplete("a haiku", schema=HaikuLines)).output)
    lines: list[str] = ctx.llm.complete("a haiku", schema=HaikuLines).output.lines
    wrong: Completion[str] = ctx.llm.complete("a haiku", schema=HaikuLines)  # the one error
'''


def _blocks(title: str) -> str:
    blocks = [m["code"] for m in FENCE.finditer(DOC.read_text(encoding="utf-8"))
              if m["title"] == title]
    assert blocks, f"docs/writing-agents.md has no python block titled {title!r}"
    return "\n\n".join(blocks)


def test_the_docs_examples_type_check_with_typed_replies(tmp_path: Path) -> None:
    for title in ("my_agents.py", "typed_replies.py"):
        (tmp_path / title).write_text(_blocks(title), encoding="utf-8")
    (tmp_path / "probe.py").write_text(PROBE, encoding="utf-8")
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nplugins = pydantic.mypy\nignore_missing_imports = True\n"
                      f"mypy_path = {REPO}\n", encoding="utf-8")
    out, err, status = api.run([
        "--config-file", str(config), "--cache-dir", str(REPO / ".mypy_cache"),
        "--no-error-summary", "--show-absolute-path", "--strict-optional",
        str(tmp_path / "my_agents.py"), str(tmp_path / "typed_replies.py"),
        str(tmp_path / "probe.py")])
    lines = out.splitlines()
    errors = [line for line in lines if ": error:" in line]
    assert len(errors) == 1 and "probe.py:12:" in errors[0], out + err  # only `wrong`
    assert 'Revealed type is "agents.replies.Completion[my_agents.HaikuLines]"' in out, out
    assert 'Revealed type is "agents.replies.Completion[str]"' in out, out
    assert 'Revealed type is "my_agents.HaikuLines"' in out, out
    assert status == 1
