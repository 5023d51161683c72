"""docs/architecture.md's folder listing ("The house") is true of the tree.

Every subpackage and top-level module of ``runtime/`` is named in the listing and every
one it names exists; every subpackage deeper down is named in its parent's entry (as
``name/``); every file name an entry gives (``store.py``, ``worker/liveness.py``) exists in
that entry's folder.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
_ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[\w.]+/|[\w]+\.py)(?: {2,}(?P<text>.*))?$")


def listing(text: str) -> dict[str, str]:
    """The listing's entries: a path (``runtime/store``) -> its description, one line."""
    block = text.split("## The house", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    stack: list[str] = []
    current = None
    for line in block.splitlines():
        match = _ENTRY.match(line)
        if match:
            depth = len(match["indent"]) // 2
            stack = [*stack[:depth], match["name"].rstrip("/")]
            current = "/".join(stack)
            entries[current] = match["text"] or ""
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def _is_package(path: Path) -> bool:
    return path.is_dir() and (path / "__init__.py").exists()


def test_runtime_parts_in_the_listing_are_the_ones_in_the_tree() -> None:
    entries = listing(DOC.read_text())
    named = {path.split("/", 1)[1] for path in entries
             if path.startswith("runtime/") and path.count("/") == 1}
    present = {p.name for p in (ROOT / "runtime").iterdir()
               if _is_package(p) or (p.suffix == ".py" and p.name != "__init__.py")}
    assert sorted(present - named) == [], "in runtime/ but not in docs/architecture.md"
    assert sorted(named - present) == [], "in docs/architecture.md but not in runtime/"


def test_every_subpackage_is_named_by_its_parent() -> None:
    entries = listing(DOC.read_text())
    missing = []
    for package in sorted(p.parent for p in (ROOT / "runtime").rglob("__init__.py")):
        relative = package.relative_to(ROOT).as_posix()
        if relative.count("/") < 2 or relative in entries:
            continue
        parent = relative.rsplit("/", 1)[0]
        while parent not in entries:  # a folder listed inside its grandparent's entry
            parent = parent.rsplit("/", 1)[0]
        if f"{package.name}/" not in entries[parent]:
            missing.append(relative)
    assert missing == [], "subpackages docs/architecture.md does not name"


def test_every_file_an_entry_names_exists_in_its_folder() -> None:
    missing = []
    for path, text in listing(DOC.read_text()).items():
        folder = ROOT / path
        if not folder.is_dir():
            continue
        for name in set(re.findall(r"(?<![\w./])([\w/]+\.py)\b", text)):
            if not (folder / name).exists() and not list(folder.rglob(Path(name).name)):
                missing.append(f"{path}: {name}")
    assert sorted(missing) == [], "files docs/architecture.md names that do not exist"


def test_every_top_level_entry_exists() -> None:
    top = [path for path in listing(DOC.read_text()) if "/" not in path]
    assert [path for path in top if not (ROOT / path).exists()] == []


def test_the_listing_is_read_as_written() -> None:
    entries = listing(DOC.read_text())
    assert "runtime/engine/worker" in entries and "liveness.py" in entries[
        "runtime/engine/worker"]
    assert "runtime/config.py" in entries and "orgchart" in entries
