"""The house rules of docs/architecture.md, read from the source with ``ast``.

- no folder under ``agents/``, ``runtime/`` or ``policies/`` holds more than 12 modules;
- ``agents`` and ``policies`` never import the store or the engine;
- the store never imports a face (the CLI or the HTTP API);
- no part of the core (store, engine, fleet, model layer, views, wiring) imports a face,
  and the HTTP face never imports the CLI (the CLI's ``serve`` starts the HTTP app).

Imports inside ``if TYPE_CHECKING:`` blocks are allowed (they are types, not
dependencies); imports inside functions count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agents", "runtime", "policies")
MAX_MODULES_PER_FOLDER = 12

#: (importing package prefix, imported package prefixes it may never reach).
FORBIDDEN = (
    ("agents", ("runtime.store", "runtime.engine")),
    ("policies", ("runtime.store", "runtime.engine")),
    ("runtime.store", ("runtime.cli", "runtime.http")),
    ("runtime.engine", ("runtime.cli", "runtime.http")),
    ("runtime.fleet", ("runtime.cli", "runtime.http")),
    ("runtime.llm", ("runtime.cli", "runtime.http")),
    # The model layer reaches the database only through the CallLedger the engine passes
    # in (runtime/llm/ledger.py); it may share the store's plain row types.
    ("runtime.llm", ("runtime.store.store", "runtime.store.reads", "runtime.store.db",
                     "runtime.engine")),
    ("runtime.views", ("runtime.cli", "runtime.http")),
    ("runtime.telemetry", ("runtime.cli", "runtime.http")),
    ("runtime.wiring", ("runtime.cli", "runtime.http")),
    ("runtime.http", ("runtime.cli",)),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield _module_name(path), path


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, source: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` imports, outside ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def _reaches(imported: str, prefix: str) -> bool:
    return imported == prefix or imported.startswith(prefix + ".")


def test_no_folder_holds_more_than_twelve_modules() -> None:
    folders: dict[Path, int] = {}
    for _name, path in _modules():
        folders[path.parent] = folders.get(path.parent, 0) + 1
    crowded = {str(f.relative_to(ROOT)): n for f, n in folders.items()
               if n > MAX_MODULES_PER_FOLDER}
    assert crowded == {}, f"split these folders (more than {MAX_MODULES_PER_FOLDER} modules)"


@pytest.mark.parametrize(("importer", "never"), FORBIDDEN)
def test_forbidden_imports(importer: str, never: tuple[str, ...]) -> None:
    broken = sorted(
        f"{name} imports {imported}"
        for name, path in _modules() if _reaches(name, importer)
        for imported in imports_of(name, path.read_text(encoding="utf-8"),
                                   path.name == "__init__.py")
        if any(_reaches(imported, banned) for banned in never)
    )
    assert broken == []


def test_the_import_reader_sees_lazy_imports_and_skips_type_checking() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from runtime.store.store import Store\n"
        "def f():\n    from runtime.engine import worker\n"
        "from . import sibling\n"
    )
    found = imports_of("policies.base", source)
    assert "runtime.engine.worker" in found and "policies.sibling" in found
    assert not any(_reaches(i, "runtime.store") for i in found)
