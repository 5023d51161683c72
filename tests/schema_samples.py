"""Smallest and largest instances of a pydantic JSON schema, for agent tests."""

from __future__ import annotations

from typing import Any


def sample(schema: dict[str, Any], mode: str, root: dict[str, Any] | None = None) -> Any:
    """The smallest (``min``) or largest (``max``) instance of a pydantic JSON schema."""
    root = root or schema
    smallest = mode == "min"
    if "$ref" in schema:
        return sample(root["$defs"][schema["$ref"].rsplit("/", 1)[-1]], mode, root)
    if "anyOf" in schema:
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        return None if smallest and len(options) < len(schema["anyOf"]) else sample(
            options[0], mode, root)
    if "enum" in schema:
        return schema["enum"][0 if smallest else -1]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        keys = schema.get("required", []) if smallest else list(props)
        return {k: sample(props[k], mode, root) for k in keys}
    if kind == "array":
        n = schema.get("minItems", 0) if smallest else schema.get("maxItems", 3)
        return [sample(schema.get("items", {"type": "string"}), mode, root) for _ in range(n)]
    if kind == "string":
        n = schema.get("minLength", 0) if smallest else schema.get("maxLength", 40)
        # Quotes, dollars and braces: the characters that break careless templating.
        return ("x" * n) if smallest else ('Ünï "q" $x {y} \n' * n)[:n]
    if kind == "boolean":
        return not smallest
    if kind in ("integer", "number"):
        return schema.get("minimum", 0) if smallest else schema.get("maximum", 7)
    return None
