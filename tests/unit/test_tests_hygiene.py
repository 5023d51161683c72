"""The tests wait on signals and read public names (issue 46), and stay so.

Two scans of every ``.py`` file under ``tests/`` (its syntax tree, nothing is run):

- **No fixed wait of 0.5 s or more**: a ``sleep`` (``time.sleep``, ``asyncio.sleep``, a
  bare ``sleep``) whose seconds are known before it runs (numbers, module constants,
  numeric constants imported from our packages, arithmetic, ``max``/``min``) and reach
  :data:`LONGEST_FIXED_WAIT`, or ``pg_sleep(N)`` in a SQL string. A test that needs time
  to pass waits for a sign that the thing happened (``tests.support.wait_until``). A
  sleep whose length comes from a task or a fake's setting (an agent's work, a server's
  delay) is what the test is about, not a wait, and is not known here.
- **No private attribute of another object**: ``x._name`` (read or written) where ``x``
  is not ``self`` or ``cls``, ``getattr``/``setattr``/``hasattr``/``delattr`` or
  ``monkeypatch.setattr`` with a ``"_name"``, and imports of private names or modules
  (a helper one test module imports from another is the tests' own code: not checked).
  Our classes offer a public, documented name for what a test needs; a test that cannot
  see something from outside asks for one.

What stays is listed below with its reason: third-party internals with no public way,
and waits that are the thing under test.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: Seconds: a fixed wait this long or longer fails the scan.
LONGEST_FIXED_WAIT = 0.5
#: Our packages: a numeric constant a sleep imports from them is read to know its length.
OUR_PACKAGES = ("agents", "bench", "orgchart", "policies", "runtime", "tests")

#: (file, the private name as written) -> why it stays.
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {
    ("tests/unit/test_queries.py", "psycopg._queries"):
        "psycopg's statement cache limit has no public name; the test holds our "
        "MAX_SENT_CHARS to it",
}

#: (file, the call as written) -> why the fixed wait stays.
WAIT_ALLOWED: dict[tuple[str, str], str] = {
    ("tests/integration/test_store_contracts.py", "pg_sleep(5)"):
        "the long statement that statement_timeout_ms (200 ms) must cancel: the thing "
        "under test, never waited for",
    ("tests/integration/test_cli_database_dropped.py", "pg_sleep(5)"):
        "the long statement that statement_timeout_ms (100 ms) must cancel, for the CLI's "
        "one-line error: the thing under test, never waited for",
    ("tests/chaos/agents.py", "asyncio.sleep(TOOL_SECONDS)"):
        "a chaos tool's work: the crash must land while a tool runs (the thing under "
        "test, not a wait)",
}

SLEEPS = {"sleep"}  # time.sleep, asyncio.sleep, anyio.sleep, a bare sleep
ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr"}
PG_SLEEP = re.compile(r"pg_sleep\(\s*([0-9.]+)\s*\)")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def scanned_files() -> list[Path]:
    """Every Python file under ``tests/`` but this one (its samples are not waits)."""
    return sorted(p for p in TESTS.rglob("*.py")
                  if "__pycache__" not in p.parts and p != Path(__file__).resolve())


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


class _Constants:
    """Numbers a file's module-level names stand for (its own and our packages')."""

    def __init__(self, tree: ast.Module) -> None:
        self.assigned: dict[str, ast.expr] = {}
        self.imported: dict[str, tuple[str, str]] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                self.assigned[node.targets[0].id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.value is not None:
                self.assigned[node.target.id] = node.value
            elif isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.split(".")[0] in OUR_PACKAGES:
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (node.module, alias.name)

    def name(self, name: str, depth: int) -> float | None:
        if name in self.assigned:
            return self.seconds(self.assigned[name], depth + 1)
        if name in self.imported:
            module, attr = self.imported[name]
            try:
                value = getattr(importlib.import_module(module), attr, None)
            except Exception:  # a module that cannot be imported here: length unknown
                return None
            return float(value) if isinstance(value, (int, float)) \
                and not isinstance(value, bool) else None
        return None

    def seconds(self, node: ast.expr, depth: int = 0) -> float | None:
        """The value of ``node`` when it is known without running the test, else None.

        For ``max(...)`` with an unknown argument, the largest known one (a lower bound).
        """
        if depth > 10:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.Name):
            return self.name(node.id, depth)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = self.seconds(node.operand, depth + 1)
            return None if value is None else -value
        if isinstance(node, ast.BinOp):
            left, right = self.seconds(node.left, depth + 1), self.seconds(node.right, depth + 1)
            if left is None or right is None:
                return None
            try:
                return {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right,
                        ast.Div: left / right if right else None}.get(type(node.op))
            except ZeroDivisionError:
                return None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("max", "min") and not node.keywords:
            values = [self.seconds(a, depth + 1) for a in node.args]
            known = [v for v in values if v is not None]
            if node.func.id == "max" and known:
                return max(known)  # at least this long
            if node.func.id == "min" and known and len(known) == len(values):
                return min(known)
        return None


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def fixed_waits(path: Path) -> Iterator[tuple[int, str, float]]:
    """``(line, the call as written, seconds)`` of the file's fixed waits of 0.5 s or more."""
    tree = _tree(path)
    constants = _Constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called_name(node) in SLEEPS and node.args:
            seconds = constants.seconds(node.args[0])
            if seconds is not None and seconds >= LONGEST_FIXED_WAIT:
                yield node.lineno, ast.unparse(node), seconds
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in PG_SLEEP.finditer(node.value):
                if float(match.group(1)) >= LONGEST_FIXED_WAIT:
                    yield node.lineno, match.group(0), float(match.group(1))


def private_reads(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, the private name as written)`` of what the file reaches into."""
    tree = _tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Call) and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value) \
                and (_called_name(node) in ATTRIBUTE_CALLS
                     or ast.unparse(node.func).endswith("monkeypatch.setattr")):
            yield node.lineno, f"{ast.unparse(node.args[0])}.{node.args[1].value}"
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if any(_private(part) for part in module.split(".")):
                yield node.lineno, module
            if module.split(".")[0] == "tests":
                continue  # one test module's helper used by another: the tests' own code
            for alias in node.names:
                if _private(alias.name):
                    yield node.lineno, f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(_private(part) for part in alias.name.split(".")):
                    yield node.lineno, alias.name


def test_no_fixed_wait_of_half_a_second_or_more() -> None:
    found = [f"{_relative(path)}:{line}: {call} ({seconds:g} s)"
             for path in scanned_files() for line, call, seconds in fixed_waits(path)
             if (_relative(path), call) not in WAIT_ALLOWED]
    assert not found, ("fixed waits: wait until a sign that the thing happened "
                       "(tests.support.wait_until) instead:\n" + "\n".join(found))


def test_no_private_attribute_of_another_object_is_read() -> None:
    found = [f"{_relative(path)}:{line}: {name}"
             for path in scanned_files() for line, name in private_reads(path)
             if (_relative(path), name) not in PRIVATE_ALLOWED]
    assert not found, ("private names read by tests: use or add a public, documented "
                       "name on the class, or observe from outside:\n" + "\n".join(found))


def test_every_allowed_site_still_exists() -> None:
    """An allowed site that is gone leaves the lists: they only shrink."""
    privates = {(_relative(p), name) for p in scanned_files() for _, name in private_reads(p)}
    waits = {(_relative(p), call) for p in scanned_files() for _, call, _ in fixed_waits(p)}
    assert set(PRIVATE_ALLOWED) <= privates, set(PRIVATE_ALLOWED) - privates
    assert set(WAIT_ALLOWED) <= waits, set(WAIT_ALLOWED) - waits


def test_the_scans_find_what_they_look_for(tmp_path: Path) -> None:
    """The scans themselves: each kind of site is found, self and short waits are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import asyncio, time\n"
        "import psycopg._queries\n"
        "from runtime.store.rows import _TASK_FIELDS\n"
        "from tests.support import _helper\n"
        "LONG = 0.25\n"
        "class A:\n"
        "    def f(self, other, monkeypatch):\n"
        "        self._x = 1\n"
        "        time.sleep(0.2)\n"
        "        time.sleep(LONG * 4)\n"
        "        time.sleep(max(1.0, other.t))\n"
        "        time.sleep(other.t)\n"
        "        asyncio.sleep(2)\n"
        "        conn.execute('SELECT pg_sleep(3)')\n"
        "        return other._y, getattr(other, '_z'), other.__dict__\n"
        "    def g(self, monkeypatch):\n"
        "        monkeypatch.setattr(A, '_w', 1)\n", encoding="utf-8")
    assert sorted((line, seconds) for line, _, seconds in fixed_waits(sample)) == [
        (10, 1.0), (11, 1.0), (13, 2.0), (14, 3.0)]
    assert sorted(name for _, name in private_reads(sample)) == [
        "A._w", "other._y", "other._z", "psycopg._queries", "runtime.store.rows._TASK_FIELDS"]
