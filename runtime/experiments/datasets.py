"""Datasets: JSONL files of cases, checked line by line and versioned by content hash.

One case per line, a JSON object:

- ``goal`` (a string: the root goal, for the default agent) or ``agent`` and ``payload``;
- ``expected`` (optional, any JSON): what the ``expected`` scorer compares the answer with;
- ``success_criteria`` / ``kill_criteria`` (optional): the root's criteria, as on submit;
- ``tags`` (optional list of strings), ``id`` (optional, a name for the case).

Blank lines and lines starting with ``#`` are skipped. A bad line is an error naming its
line number; nothing is stored then. The version is the sha256 of the canonical cases, so
the same cases added twice are one version and an edited file is a new one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.core.canonical import canonical_sha256
from runtime.errors import BadInput

#: The keys a case may have.
CASE_KEYS = frozenset({"id", "goal", "agent", "payload", "expected", "success_criteria",
                       "kill_criteria", "tags", "type"})
#: The most cases one dataset may hold.
MAX_CASES = 10_000


@dataclass(frozen=True)
class Case:
    """One case of a dataset, as stored (``body``) and as the runner reads it."""

    body: dict[str, Any]
    position: int = 0
    tags: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        """The case's ``id``, or its goal cut short, or its position."""
        body = self.body
        return str(body.get("id") or (body.get("goal") or "")[:60] or f"case {self.position}")

    @property
    def expected(self) -> Any:
        """What the answer should be (``None`` when the case does not say)."""
        return self.body.get("expected")


def _check_case(body: Any, where: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadInput(f"{where}: a case is a JSON object, not {type(body).__name__}")
    unknown = sorted(set(body) - CASE_KEYS)
    if unknown:
        raise BadInput(f"{where}: unknown key {unknown[0]!r} (a case has "
                       f"{', '.join(sorted(CASE_KEYS))})")
    goal, payload = body.get("goal"), body.get("payload")
    if goal is None and payload is None:
        raise BadInput(f"{where}: a case needs 'goal' (a string) or 'agent' and 'payload'")
    if goal is not None and (not isinstance(goal, str) or not goal.strip()):
        raise BadInput(f"{where}: 'goal' must be a non-empty string")
    if payload is not None and not isinstance(payload, dict):
        raise BadInput(f"{where}: 'payload' must be a JSON object")
    if "agent" in body and not isinstance(body["agent"], str):
        raise BadInput(f"{where}: 'agent' must be an agent's name")
    tags = body.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise BadInput(f"{where}: 'tags' must be a list of strings")
    return body


def parse_cases(text: str, source: str = "<dataset>") -> list[Case]:
    """Parse JSONL ``text`` into cases; a bad line raises :class:`BadInput` naming it."""
    cases: list[Case] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{source}:{number}"
        try:
            body = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{where}: malformed JSON ({exc.msg})") from None
        body = _check_case(body, where)
        cases.append(Case(body, len(cases), tuple(body.get("tags", ()))))
        if len(cases) > MAX_CASES:
            raise BadInput(f"{source}: more than {MAX_CASES} cases")
    if not cases:
        raise BadInput(f"{source}: no cases (one JSON object per line)")
    return cases


def read_cases(path: Path) -> list[Case]:
    """Read and parse a JSONL file (:func:`parse_cases`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot read dataset {path}: {exc.strerror or exc}") from None
    return parse_cases(text, str(path))


def version_of(cases: Sequence[Case]) -> str:
    """The content hash that names a dataset's version (16 hex digits of sha256)."""
    return canonical_sha256([c.body for c in cases])[:16]
