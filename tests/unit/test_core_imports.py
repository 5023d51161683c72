"""The shared core imports the standard library only (so every part may import it)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "runtime" / "core"


def test_the_core_imports_only_the_standard_library() -> None:
    found: dict[str, str] = {}
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            for name in names:
                if name.split(".")[0] not in sys.stdlib_module_names | {"__future__"}:
                    found[f"{path.name}: {name}"] = name
    assert sorted(found) == []
