"""No broad exception is swallowed without a word (issue 46).

``contextlib.suppress(Exception)`` and an ``except Exception:`` whose body only passes
hide the error that would explain a failure. Each broad catch in the project logs with
a reason or raises again; narrow catches (``suppress(ProcessLookupError)``) are fine.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agents", "runtime", "policies", "orgchart")
BROAD = {"Exception", "BaseException"}


def _names(node: ast.expr | None) -> set[str]:
    """The exception names a handler or ``suppress`` call names (bare ``except``: broad)."""
    if node is None:
        return {"BaseException"}
    items = node.elts if isinstance(node, ast.Tuple) else [node]
    return {n.id if isinstance(n, ast.Name) else n.attr for n in items
            if isinstance(n, ast.Name | ast.Attribute)}


def _silent(body: list[ast.stmt]) -> bool:
    return all(isinstance(s, ast.Pass | ast.Continue)
               or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
               for s in body)


def silent_broad_catches(source: str, name: str) -> Iterator[str]:
    """Where ``source`` swallows a broad exception without a word."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if func == "suppress" and any(_names(a) & BROAD for a in node.args):
                yield f"{name}:{node.lineno}: suppress({ast.unparse(node.args[0])})"
        if isinstance(node, ast.ExceptHandler) and _names(node.type) & BROAD \
                and _silent(node.body):
            caught = ast.unparse(node.type) if node.type is not None else ""
            yield f"{name}:{node.lineno}: except {caught}: pass"


def test_no_broad_exception_is_swallowed_silently() -> None:
    found = [hit for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for hit in silent_broad_catches(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == [], "log with a reason or raise again:\n" + "\n".join(found)


def test_the_check_catches_both_forms() -> None:
    source = ("import contextlib\nwith contextlib.suppress(Exception):\n    f()\n"
              "try:\n    f()\nexcept Exception:\n    pass\n"
              "try:\n    f()\nexcept (OSError, Exception):\n    log.warning('x')\n"
              "with contextlib.suppress(ProcessLookupError):\n    f()\n")
    hits = sorted(hit.split(": ")[0] for hit in silent_broad_catches(source, "m"))
    assert hits == ["m:2", "m:6"]
