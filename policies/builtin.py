"""The built-in rules, configured in ``[policies]`` of ``orgchart.toml``.

=================  ============  ==========================================================
rule               checks        setting
=================  ============  ==========================================================
max_depth          input, deleg  ``max_depth``: deepest level a task may sit at (root = 0)
max_children       delegation    ``max_children``: children one task may create at once
max_payload_bytes  input, deleg  ``max_payload_bytes``: size of a payload as compact JSON
delegation_edges   delegation    ``delegation_edges``: children only to ``delegates_to``
forbidden_output   output        ``forbidden_patterns``: regexes over the result's JSON
output_schema      output        ``output_schema``: result matches the agent's output model
model_price        (worker)      ``[cost]``: a model without a price is a violation
require_approval   delegation    ``require_approval``, ``approve_above_usd``: holds, not
                                 refuses (``policies/approval.py``)
allowed_tools      tool call     ``allowed_tools``: ``{agent = [tool, ...]}``, the tools an
                                 agent may call (an agent not listed may call its own)
=================  ============  ==========================================================

Every rule can be switched off by name in ``[policies] disabled`` except ``model_price``:
a model call without a price would be a silent zero cost, which orgchart never allows.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import orjson

from agents.base import HUMAN
from policies.approval import RequireApproval
from policies.base import Policy, Violation
from runtime.config import DEFAULT_FORBIDDEN_PATTERNS, ConfigError

if TYPE_CHECKING:
    from agents.base import ChildSpec, TaskView
    from runtime.config import Settings

#: What each default forbidden pattern finds, for messages that never echo the match.
PATTERN_KINDS: dict[str, str] = dict(
    zip(
        DEFAULT_FORBIDDEN_PATTERNS,
        ("a private key", "an API key", "an AWS access key", "a GitHub token",
         "an e-mail address"),
        strict=True,
    )
)
#: How many schema errors an ``output_schema`` violation lists.
MAX_SCHEMA_ERRORS = 3
#: Longest single schema error message kept (they can quote the offending value).
MAX_ERROR_CHARS = 200


#: One encoder each, made once: ``json.dumps`` with options builds a new one per call.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str)
_TEXT = json.JSONEncoder(ensure_ascii=False, default=str)
#: ``_TEXT``'s C encoder, made once: ``JSONEncoder.encode`` makes one per call, half the
#: time of encoding a small result. No circular check: a result reaches the output
#: rules as plain JSON values (``to_json_value`` would not have ended on a cycle).
_make_c_encoder: Any = getattr(json.encoder, "c_make_encoder", None)  # None without _json
_C_TEXT = None if _make_c_encoder is None else _make_c_encoder(
    None, str, json.encoder.encode_basestring, None, ": ", ", ", False, False, True)


def result_text(result: Any) -> str:
    """The JSON text the forbidden patterns are searched in: ``_TEXT.encode(result)``."""
    if _C_TEXT is None or isinstance(result, str):
        return _TEXT.encode(result)
    return "".join(_C_TEXT(result, 0))


def payload_bytes(payload: Any) -> int:
    """Size of ``payload`` as compact UTF-8 JSON, the measure ``max_payload_bytes`` uses."""
    return len(_COMPACT.encode(payload).encode())


def payload_bytes_over(payload: Any, limit: int) -> int | None:
    """:func:`payload_bytes` when it may exceed ``limit``; None when it surely does not.

    orjson writes the same compact UTF-8 JSON about ten times faster; where the two differ
    (a float's exponent, ``1e16`` against ``1e+16``; an infinity, ``null`` against
    ``Infinity``) the standard one is at most 2.25 times as long, and whatever orjson
    refuses (an integer above 64 bits, a key that is not a string) is measured the
    standard way. So a payload whose orjson size, tripled, is within ``limit`` is within
    it; any other is measured exactly, and its size is the one reported.
    """
    try:
        if 3 * len(orjson.dumps(payload, default=str)) <= limit:
            return None
    except TypeError:
        pass
    size = payload_bytes(payload)
    return size if size > limit else None


def json_path(parts: Any) -> str:
    """``$.a.b[0]`` for a sequence of keys and indexes."""
    out = "$"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


class MaxDepth(Policy):
    """A task may not sit deeper than ``max_depth`` (a root is at depth 0)."""

    name = "max_depth"
    description = "Tasks may not sit deeper than max_depth; a parent escalates instead."

    def validate_input(self, task: TaskView) -> Violation | None:
        """Refuse to run a task deeper than the limit."""
        limit = self.settings.policies.max_depth
        if task.depth > limit:
            return self.violation(f"task depth {task.depth} exceeds max_depth {limit}")
        return None

    def validate_delegation(self, parent: TaskView, children: list[ChildSpec]) -> Violation | None:
        """Children one level below the limit are refused, so the parent escalates."""
        limit = self.settings.policies.max_depth
        if children and parent.depth + 1 > limit:
            return self.violation(
                f"children would sit at depth {parent.depth + 1}, beyond max_depth {limit}; "
                f"agent {parent.agent!r} may not delegate from depth {parent.depth}"
            )
        return None

    def settings_view(self) -> dict[str, Any]:
        """``max_depth``."""
        return {"max_depth": self.settings.policies.max_depth}


class MaxChildren(Policy):
    """One task may create at most ``max_children`` children at once."""

    name = "max_children"
    description = "A task may create at most max_children children in one delegation."

    def validate_delegation(self, parent: TaskView, children: list[ChildSpec]) -> Violation | None:
        """Too many children: refuse the whole delegation."""
        limit = self.settings.policies.max_children
        if len(children) > limit:
            return self.violation(
                f"agent {parent.agent!r} asked for {len(children)} children; "
                f"max_children is {limit}"
            )
        return None

    def settings_view(self) -> dict[str, Any]:
        """``max_children``."""
        return {"max_children": self.settings.policies.max_children}


class MaxPayloadBytes(Policy):
    """A payload may not exceed ``max_payload_bytes`` as compact JSON."""

    name = "max_payload_bytes"
    description = "Payloads (a task's and each child's) may not exceed max_payload_bytes."

    def validate_input(self, task: TaskView) -> Violation | None:
        """Check the size of the task's own payload."""
        limit = self.settings.policies.max_payload_bytes
        size = payload_bytes_over(task.payload, limit)
        if size is not None:
            return self.violation(f"payload is {size} bytes; max_payload_bytes is {limit}")
        return None

    def validate_delegation(self, parent: TaskView, children: list[ChildSpec]) -> Violation | None:
        """Every child's payload."""
        limit = self.settings.policies.max_payload_bytes
        for child in children:
            size = payload_bytes_over(child.payload, limit)
            if size is not None:
                return self.violation(
                    f"child {child.key!r} for agent {child.agent!r} has a payload of {size} "
                    f"bytes; max_payload_bytes is {limit}"
                )
        return None

    def settings_view(self) -> dict[str, Any]:
        """``max_payload_bytes``."""
        return {"max_payload_bytes": self.settings.policies.max_payload_bytes}


class DelegationEdges(Policy):
    """Children only go to agents listed in the parent agent's ``delegates_to``."""

    name = "delegation_edges"
    description = "An agent may delegate only to the agents in its delegates_to (the org chart)."

    @classmethod
    def inactive_reason(cls, settings: Settings) -> str | None:
        """Off when ``[policies] delegation_edges = false``."""
        return None if settings.policies.delegation_edges else "[policies] delegation_edges = false"

    def validate_delegation(self, parent: TaskView, children: list[ChildSpec]) -> Violation | None:
        """Each child's agent must be an edge of the org chart from the parent's agent."""
        if self.agents is None:
            return None
        if parent.agent not in self.agents:
            return self.violation(f"agent {parent.agent!r} is not registered; it may not delegate")
        allowed = self.agents.get(parent.agent).delegates_to
        for child in children:
            # Any agent may ask a person (the built-in agent 'human'): no edge needed.
            if child.agent not in allowed and child.agent != HUMAN:
                edges = ", ".join(allowed) if allowed else "nobody"
                return self.violation(
                    f"agent {parent.agent!r} may not delegate to {child.agent!r} "
                    f"(child {child.key!r}); its delegates_to: {edges}"
                )
        return None

    def settings_view(self) -> dict[str, Any]:
        """``delegation_edges``."""
        return {"delegation_edges": self.settings.policies.delegation_edges}


class ForbiddenOutput(Policy):
    """No result may contain a forbidden pattern (secrets, e-mail addresses by default)."""

    name = "forbidden_output"
    description = "Results may not match forbidden_patterns (keys, tokens, e-mail addresses)."

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.patterns: list[tuple[re.Pattern[str], str]] = []
        for number, source in enumerate(settings.policies.forbidden_patterns, start=1):
            try:
                compiled = re.compile(source)
            except re.error as exc:
                raise ConfigError(
                    f"[policies] forbidden_patterns: pattern {number} ({source!r}) is not a "
                    f"valid regular expression: {exc}"
                ) from None
            kind = PATTERN_KINDS.get(source, f"forbidden pattern {number}")
            self.patterns.append((compiled, kind))

    @classmethod
    def inactive_reason(cls, settings: Settings) -> str | None:
        """Off when ``[policies] forbidden_patterns`` is empty."""
        return None if settings.policies.forbidden_patterns else "no forbidden_patterns set"

    def validate_output(self, task: TaskView, result: Any) -> Violation | None:
        """Search the JSON text of the result; name the kind and where, never the match."""
        text = result_text(result)
        for pattern, kind in self.patterns:
            if pattern.search(text):
                where = _find_leaf(result, pattern)
                at = f" at {where}" if where else ""
                return self.violation(f"the result contains {kind}{at}")
        return None

    def settings_view(self) -> dict[str, Any]:
        """Return the patterns, each with the kind it reports."""
        return {
            "forbidden_patterns": [
                {"pattern": p.pattern, "reports": kind} for p, kind in self.patterns
            ]
        }


def _find_leaf(value: Any, pattern: re.Pattern[str], path: tuple[Any, ...] = ()) -> str | None:
    """Return the JSON path of the first key or string the pattern matches, if any."""
    if isinstance(value, dict):
        for key, item in value.items():
            if pattern.search(str(key)):
                return json_path((*path, key))
            found = _find_leaf(item, pattern, (*path, key))
            if found:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _find_leaf(item, pattern, (*path, index))
            if found:
                return found
    elif isinstance(value, str) and pattern.search(value):
        return json_path(path)
    return None


class OutputSchema(Policy):
    """A result must match the JSON schema of its agent's ``output_model``."""

    name = "output_schema"
    description = "Results must match the JSON schema of the agent's output_model."

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._validators: dict[type, Any] = {}

    @classmethod
    def inactive_reason(cls, settings: Settings) -> str | None:
        """Off when ``[policies] output_schema = false``."""
        return None if settings.policies.output_schema else "[policies] output_schema = false"

    def _validator(self, model: type) -> Any:
        """The schema's validator; None for a schema every JSON object matches."""
        if model not in self._validators:
            schema = model.model_json_schema()  # type: ignore[attr-defined]
            self._validators[model] = None if _any_object(schema) else schema_validator(schema)
        return self._validators[model]

    def validate_output(self, task: TaskView, result: Any) -> Violation | None:
        """Validate with jsonschema; list the first errors with their paths."""
        if self.agents is None or task.agent not in self.agents:
            return None
        validator = self._validator(self.agents.get(task.agent).output_model)
        if validator is None:  # any object matches: only the type is left to check
            if isinstance(result, dict):
                return None
            validator = schema_validator(_OBJECT)  # says what the full schema would
        from jsonschema.exceptions import relevance

        errors = sorted(validator.iter_errors(result), key=relevance)
        if not errors:
            return None
        listed = "; ".join(
            f"{json_path(e.absolute_path)}: {_clip(e.message)}" for e in errors[:MAX_SCHEMA_ERRORS]
        )
        extra = len(errors) - MAX_SCHEMA_ERRORS
        more = f" (and {extra} more)" if extra > 0 else ""
        return self.violation(
            f"the result does not match agent {task.agent!r}'s output schema: {listed}{more}"
        )

    def settings_view(self) -> dict[str, Any]:
        """``output_schema``."""
        return {"output_schema": self.settings.policies.output_schema}


#: The keys of a schema that any JSON object matches (a model with no fields that allows
#: extra ones, pydantic's ``extra="allow"``): checked by type alone, not by jsonschema.
_ANY_OBJECT_KEYS = frozenset({"type", "properties", "additionalProperties", "title",
                              "description"})
_OBJECT: dict[str, Any] = {"type": "object"}


def schema_validator(schema: Any) -> Any:
    """A jsonschema validator of ``schema``.

    jsonschema is imported on first use: about 50 ms of every start-up (a CLI command's,
    a worker's) that checks no schema.
    """
    from jsonschema.validators import validator_for

    return validator_for(schema)(schema)


def _any_object(schema: dict[str, Any]) -> bool:
    """Whether every JSON object, and nothing else, matches ``schema``."""
    return (schema.get("type") == "object" and schema.keys() <= _ANY_OBJECT_KEYS
            and not schema.get("properties") and schema.get("additionalProperties", True) is True)


def _clip(message: str) -> str:
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


class ModelPrice(Policy):
    """A model without a configured price is a violation (enforced by the worker).

    The worker turns ``runtime.errors.UnknownPrice`` into this rule's violation; the class
    is here so ``orgchart policies`` lists the rule and the prices it knows.
    """

    name = "model_price"
    description = "A model call without a configured price escalates (never a silent zero cost)."

    def settings_view(self) -> dict[str, Any]:
        """Return the route rates and per-model prices from ``[cost]``."""
        cost = self.settings.cost

        def show(value: Any) -> str | None:
            return None if value is None else str(value)

        return {
            "local_per_token": show(cost.local_per_token),
            "cloud_per_token": show(cost.cloud_per_token),
            "prices": {model: str(price) for model, price in cost.prices.items()},
        }


class AllowedTools(Policy):
    """An agent listed in ``allowed_tools`` may call only the tools named for it.

    A refused call is never run: the model is told the tool is not allowed, as for bad
    arguments (``runtime.llm.tool_loop``).
    """

    name = "allowed_tools"
    description = "Agents listed in allowed_tools may call only the tools named for them."

    @classmethod
    def inactive_reason(cls, settings: Settings) -> str | None:
        """Off while no agent is listed."""
        return None if settings.policies.allowed_tools else "no agent listed in allowed_tools"

    def validate_tool(self, task: TaskView, tool: str) -> Violation | None:
        """Refuse a tool that is not among the agent's allowed ones."""
        allowed = self.settings.policies.allowed_tools.get(task.agent)
        if allowed is None or tool in allowed:
            return None
        return self.violation(f"agent {task.agent!r} may not call tool {tool!r} "
                              f"(allowed: {', '.join(allowed) or 'none'})")

    def settings_view(self) -> dict[str, Any]:
        """``allowed_tools``."""
        return {"allowed_tools": self.settings.policies.allowed_tools}


#: The built-in rules, in the order they run.
BUILTIN_POLICIES: tuple[type[Policy], ...] = (
    MaxDepth,
    MaxChildren,
    MaxPayloadBytes,
    DelegationEdges,
    ForbiddenOutput,
    OutputSchema,
    ModelPrice,
    RequireApproval,
    AllowedTools,
)
#: Rules ``[policies] disabled`` may not name, with the reason.
MANDATORY_RULES: dict[str, str] = {
    "model_price": "a model call without a price would be a silent zero cost",
}
