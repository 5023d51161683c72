"""Readable messages for the HTTP API's 422 answers (one line per problem)."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError

from runtime.http.constraints import meaning


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validation_message(exc: RequestValidationError) -> str:
    """One readable line per problem: where it is and what is wrong."""
    parts: list[str] = []
    for e in exc.errors()[:5]:
        loc = [str(p) for p in e.get("loc", ())]
        kind, field = (loc[0], ".".join(loc[1:])) if loc else ("request", "")
        where = f"{kind}.{field}" if field else kind
        typ = e.get("type", "")
        if typ == "json_invalid":
            parts.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', '')}")
        elif not field and kind == "body" and isinstance(e.get("input"), bytes | bytearray):
            parts.append("the body must be a JSON object sent with "
                         "Content-Type: application/json")
        elif typ == "missing" and not field:
            parts.append(f"the {kind} is missing")
        elif typ == "missing":
            parts.append(f"{kind}: missing field {field!r}")
        elif typ == "extra_forbidden":
            parts.append(f"{kind}: unknown field {field!r}")
        elif typ == "uuid_parsing":
            parts.append(f"{field.replace('_', ' ')} {short(e.get('input'))} is not a UUID")
        elif typ == "string_pattern_mismatch" and meaning(e.get("ctx", {}).get("pattern", "")):
            parts.append(f"{where} {meaning(e['ctx']['pattern'])} (got {short(e.get('input'))})")
        elif typ == "value_error":  # a model's own check: its message is the sentence
            message = str(e.get("msg", "invalid")).removeprefix("Value error, ")
            parts.append(f"{where}: {message}" if field else message)
        else:
            parts.append(f"{where}: {e.get('msg', 'invalid')}"
                         + (f" (got {short(e['input'])})" if "input" in e and field else ""))
    return "; ".join(parts) or "the request is malformed"
