"""An agent class's version, as every task it runs records it (``agent_version``).

A class that sets ``version`` is recorded with it. Otherwise its version is a short hash
of its source (:func:`source_version`, what ``inspect.getsource`` gives), cut from the
lines its module had when the class was defined (``Agent.loaded_lines``), so the hash is
of the code that was loaded even if the file is edited before the first read.

Finding the class in those lines (an ``ast`` parse of the module, ``inspect``'s way)
waits for the first read: done at import it cost about 3 ms a class, 50 ms of every
start-up for the built-in agents alone. The first reads may come from many threads at
once (a worker's first batch): one of them makes the hash under :data:`_VERSION_LOCK`,
the others wait for it and read the same answer. Parsing one module in many threads at
once is not safe on CPython 3.11 (``SystemError: AST constructor recursion depth
mismatch``), and the task that met it failed as an agent error.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import threading
import weakref

from agents.base import Agent, module_lines

#: Held while an agent class's default version is made (one parse at a time).
_VERSION_LOCK = threading.Lock()
#: The default versions made so far (a class that goes away takes its entry with it).
_MADE: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()


def agent_version(cls: type[Agent]) -> str:
    """The version a task of ``cls`` records: its own ``version``, else its source's hash."""
    named = cls.__dict__.get("version")
    if isinstance(named, str) and named:
        return named
    made = _MADE.get(cls)
    if made is None:
        with _VERSION_LOCK:
            made = _MADE.get(cls)
            if made is None:
                lines = cls.__dict__.get("loaded_lines") or module_lines(cls)
                made = _MADE[cls] = lines_version(cls, lines)
    return made


def source_version(cls: type) -> str:
    """A short hash of a class's source (its qualified name when the source is unknown)."""
    try:
        text = inspect.getsource(cls)
    except (OSError, TypeError):
        text = f"{cls.__module__}.{cls.__qualname__}"
    return _short_hash(text)


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def lines_version(cls: type, lines: list[str]) -> str:
    """:func:`source_version` of ``cls``, its source cut from ``lines`` (``inspect.getsource``).

    Parses ``lines`` (before Python 3.13): :func:`agent_version` calls it once per class,
    under :data:`_VERSION_LOCK`.
    """
    first = _first_line(cls, lines) if lines else None
    text = (f"{cls.__module__}.{cls.__qualname__}" if first is None
            else "".join(inspect.getblock(lines[first:])))
    return _short_hash(text)


def _first_line(cls: type, lines: list[str]) -> int | None:
    """Where ``cls`` starts in ``lines`` (its first decorator), 0-based, as ``inspect`` finds it."""
    known = getattr(cls, "__firstlineno__", None)  # Python 3.13 records it
    if isinstance(known, int):
        return known - 1
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return None
    finder = _ClassFinder(cls.__qualname__)
    finder.visit(tree)
    return finder.found


class _ClassFinder(ast.NodeVisitor):
    """The first class definition whose qualified name is ``qualname`` (``inspect``'s walk)."""

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname
        self.stack: list[str] = []
        self.found: int | None = None

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack += [node.name, "<locals>"]
        self.generic_visit(node)
        del self.stack[-2:]

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.stack.append(node.name)
        if self.found is None and ".".join(self.stack) == self.qualname:
            self.found = (node.decorator_list[0].lineno if node.decorator_list
                          else node.lineno) - 1
        self.generic_visit(node)
        self.stack.pop()
