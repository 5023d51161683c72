"""Deterministic, schema-valid JSON instances: what the offline backend answers.

:func:`instance_for_schema` walks a JSON Schema (the output of pydantic's
``model_json_schema()``: ``$defs``/``$ref``, ``anyOf`` for Optional, ``allOf``, enums and
consts, arrays with ``minItems``/``maxItems``/``uniqueItems``/``prefixItems``, numbers with
bounds and ``multipleOf``, strings with lengths, formats and patterns, dicts through
``additionalProperties``) and builds one instance that validates against it. Everything
is derived from a hash of the prompt and the schema, so the same request always gets the
same answer, and every free-text string reads ``"offline: <first words of the prompt>
(<field>)"`` so nobody mistakes it for a model's work.

Recursive schemas are cut off: past :data:`MAX_OPTIONAL_DEPTH` levels only required
fields are filled, arrays get their minimum length and Optional fields become null.
A schema that cannot be satisfied (``false``, an unresolvable ``$ref``, a pattern the
sampler cannot match) raises :class:`SchemaUnsatisfiable` naming the field.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
import math
import random
import re
import uuid
from collections.abc import Mapping

# The standard library's regex parser, the one way to sample a string for a ``pattern``:
# private since 3.11 (``sre_parse`` is its deprecated public alias), there is no other.
from re import _parser as _sre_parse  # type: ignore[attr-defined]
from typing import Any

from runtime.core.canonical import canonical_json, canonical_json_spaced

#: Past this depth only required fields are filled and Optional fields become null.
MAX_OPTIONAL_DEPTH = 4
#: A schema nesting deeper than this (through required fields) is refused.
MAX_DEPTH = 32
#: Items per array when the schema leaves the length open.
DEFAULT_ARRAY_ITEMS = 2
#: Words of the prompt quoted in each offline string.
SNIPPET_WORDS = 8
#: Attempts at sampling a string that matches a ``pattern``.
PATTERN_ATTEMPTS = 25


class SchemaUnsatisfiable(ValueError):
    """The offline generator cannot build a valid instance of this schema."""


def prompt_snippet(prompt: str, words: int = SNIPPET_WORDS) -> str:
    """Return the first ``words`` words of ``prompt`` on one line ("..." when cut)."""
    parts = prompt.split()
    snippet = " ".join(parts[:words])
    return snippet + ("..." if len(parts) > words else "") if snippet else "(empty prompt)"


def offline_text(prompt: str) -> str:
    """Return the offline backend's free-text answer to ``prompt``."""
    return f"offline: {prompt_snippet(prompt)}"


def instance_for_schema(schema: Mapping[str, Any] | bool, prompt: str) -> Any:
    """Build a deterministic instance of ``schema`` labelled with the start of ``prompt``.

    Args:
        schema: a JSON Schema (a dict, or ``True``/``False``).
        prompt: the request's prompt; its hash seeds every choice.

    Raises:
        SchemaUnsatisfiable: no valid instance can be built; the message names the field.

    """
    canonical = canonical_json_spaced(schema)  # seeds the answer: the older form, kept
    digest = hashlib.sha256(f"{prompt}\x00{canonical}".encode()).digest()
    generator = _Generator(schema, random.Random(int.from_bytes(digest[:8], "big")),
                           prompt_snippet(prompt))
    return generator.value(schema, "value", 0)


class _Generator:
    def __init__(self, root: Mapping[str, Any] | bool, rng: random.Random, snippet: str) -> None:
        self.root = root
        self.rng = rng
        self.snippet = snippet

    # ------------------------------------------------------------------ dispatch
    def value(self, schema: Any, name: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise SchemaUnsatisfiable(
                f"schema nests deeper than {MAX_DEPTH} levels at {name!r} "
                "(a recursive field that is required at every level?)"
            )
        if schema is True:
            schema = {}
        if schema is False:
            raise SchemaUnsatisfiable(f"the schema of {name!r} is false: no value is valid")
        schema = self._resolve(schema, name)
        if "const" in schema:
            return copy.deepcopy(schema["const"])
        if "enum" in schema:
            if not schema["enum"]:
                raise SchemaUnsatisfiable(f"the enum of {name!r} is empty")
            return copy.deepcopy(self.rng.choice(schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                base = {k: v for k, v in schema.items() if k not in (key, "default")}
                option = self._pick_option(schema[key], name, depth)
                return self.value({**base, **option}, name, depth)
        kind = self._type(schema, depth)
        if kind == "object":
            return self._object(schema, name, depth)
        if kind == "array":
            return self._array(schema, name, depth)
        if kind in ("integer", "number"):
            return self._number(schema, name, integer=kind == "integer")
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        return self._string(schema, name, depth)

    def _resolve(self, schema: Mapping[str, Any], name: str) -> dict[str, Any]:
        out = dict(schema)
        for _ in range(MAX_DEPTH):
            if "$ref" in out:
                target = self._lookup(out.pop("$ref"), name)
                out = {**target, **out}
                continue
            if "allOf" in out:
                parts = out.pop("allOf")
                merged: dict[str, Any] = {}
                for part in parts:
                    part = self._resolve(part if isinstance(part, Mapping) else {}, name)
                    for key, val in part.items():
                        if key == "properties":
                            merged.setdefault("properties", {}).update(val)
                        elif key == "required":
                            merged["required"] = sorted(set(merged.get("required", [])) | set(val))
                        else:
                            merged[key] = val
                out = {**merged, **out}
                continue
            return out
        raise SchemaUnsatisfiable(f"$ref chain at {name!r} does not end")

    def _lookup(self, ref: str, name: str) -> dict[str, Any]:
        if not ref.startswith("#"):
            raise SchemaUnsatisfiable(f"cannot resolve $ref {ref!r} at {name!r}: only local refs")
        node: Any = self.root
        for raw in [p for p in ref[1:].split("/") if p]:
            part = raw.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, Mapping) or part not in node:
                raise SchemaUnsatisfiable(f"cannot resolve $ref {ref!r} at {name!r}")
            node = node[part]
        if node is True:
            return {}
        if not isinstance(node, Mapping):
            raise SchemaUnsatisfiable(f"$ref {ref!r} at {name!r} does not name a schema")
        return dict(node)

    def _pick_option(self, options: list[Any], name: str, depth: int) -> dict[str, Any]:
        resolved = [self._resolve(o if isinstance(o, Mapping) else {}, name) for o in options]
        nulls = [o for o in resolved if o.get("type") == "null"]
        others = [o for o in resolved if o.get("type") != "null"]
        if nulls and (depth >= MAX_OPTIONAL_DEPTH or not others):
            return nulls[0]
        if not others:
            raise SchemaUnsatisfiable(f"no option of {name!r} can be satisfied")
        return others[0]

    @staticmethod
    def _type(schema: Mapping[str, Any], depth: int) -> str:
        kind = schema.get("type")
        if isinstance(kind, list):
            non_null = [k for k in kind if k != "null"]
            if not non_null or ("null" in kind and depth >= MAX_OPTIONAL_DEPTH):
                return "null"
            return str(non_null[0])
        if kind is not None:
            return str(kind)
        if any(k in schema for k in ("properties", "additionalProperties", "required")):
            return "object"
        if any(k in schema for k in ("items", "prefixItems", "minItems")):
            return "array"
        if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum",
                                     "exclusiveMaximum", "multipleOf")):
            return "number"
        return "string"

    # ------------------------------------------------------------------ containers
    def _object(self, schema: Mapping[str, Any], name: str, depth: int) -> dict[str, Any]:
        props: Mapping[str, Any] = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        deep = depth >= MAX_OPTIONAL_DEPTH
        out: dict[str, Any] = {}
        for key, sub in props.items():
            if key in required or not deep:
                out[key] = self.value(sub, key, depth + 1)
        max_props = schema.get("maxProperties")
        if max_props is not None:
            for key in [k for k in reversed(list(out)) if k not in required]:
                if len(out) <= max_props:
                    break
                del out[key]
        for key in required - set(out):  # required but not described: anything will do
            out[key] = self.value({}, key, depth + 1)
        extra_schema = schema.get("additionalProperties", True)
        wanted = max(int(schema.get("minProperties", 0)) - len(out), 0)
        if not props and extra_schema is not False and not deep and wanted == 0:
            wanted = 1  # a dict[str, X]: show one entry
        if max_props is not None:
            wanted = min(wanted, max(max_props - len(out), 0))
        for i in range(wanted):
            if extra_schema is False:
                raise SchemaUnsatisfiable(
                    f"{name!r} needs {schema.get('minProperties')} properties but allows no "
                    "additional ones"
                )
            key = f"offline_{i + 1}"
            out[key] = self.value({} if extra_schema is True else extra_schema, key, depth + 1)
        return out

    def _array(self, schema: Mapping[str, Any], name: str, depth: int) -> list[Any]:
        items = schema.get("items", {})
        prefix = list(schema.get("prefixItems") or [])
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, schema.get("additionalItems", {})
        low = int(schema.get("minItems", 0))
        high = schema.get("maxItems")
        count = low if depth >= MAX_OPTIONAL_DEPTH else max(low, DEFAULT_ARRAY_ITEMS, len(prefix))
        if items is False:
            count = min(count, len(prefix))
        if high is not None:
            count = min(count, int(high))
        if count < low:
            raise SchemaUnsatisfiable(f"{name!r} needs {low} items but allows at most {count}")
        out: list[Any] = []
        unique = bool(schema.get("uniqueItems"))
        attempts = 0
        while len(out) < count:
            i = len(out)
            sub = prefix[i] if i < len(prefix) else items
            item = self.value(sub, f"{name} {i + 1 + attempts}", depth + 1)
            if unique and any(_json_equal(item, seen) for seen in out):
                attempts += 1
                if attempts > 10 * count + 10:
                    if len(out) >= low:
                        break
                    raise SchemaUnsatisfiable(f"cannot find {low} distinct items for {name!r}")
                continue
            out.append(item)
        return out

    # ------------------------------------------------------------------ scalars
    def _number(self, schema: Mapping[str, Any], name: str, *, integer: bool) -> int | float:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if isinstance(xlo, bool):  # draft 4: a flag on minimum
            lo, xlo = (None, lo) if xlo else (lo, None)
        if isinstance(xhi, bool):
            hi, xhi = (None, hi) if xhi else (hi, None)
        lows = [float(v) for v in (lo, xlo) if v is not None]
        highs = [float(v) for v in (hi, xhi) if v is not None]
        low: float = max(lows) if lows else (min(highs) - 100 if highs else 0.0)
        high: float = min(highs) if highs else low + 100

        def ok(v: float) -> bool:
            return ((lo is None or v >= lo) and (hi is None or v <= hi)
                    and (xlo is None or v > xlo) and (xhi is None or v < xhi))

        step = schema.get("multipleOf")
        if step:
            first, last = math.ceil(low / step), math.floor(high / step)
            if first <= last:
                start = self.rng.randint(first, last)
                for k in list(range(start, last + 1)) + list(range(first, start)):
                    v = k * step
                    if integer and v != int(v):
                        continue
                    v = int(v) if integer or float(v).is_integer() else v
                    if ok(v) and (v / step) == int(v / step):
                        return v
            raise SchemaUnsatisfiable(f"no multiple of {step} fits the bounds of {name!r}")
        if integer:
            first, last = math.ceil(low), math.floor(high)
            if xlo is not None and first <= xlo:
                first = math.floor(xlo) + 1
            if xhi is not None and last >= xhi:
                last = math.ceil(xhi) - 1
            if first > last:
                raise SchemaUnsatisfiable(f"no integer fits the bounds of {name!r}")
            return self.rng.randint(first, last)
        for v in (round(self.rng.uniform(low, high), 2), (low + high) / 2):
            if ok(v):
                return v
        raise SchemaUnsatisfiable(f"no number fits the bounds of {name!r}")

    def _string(self, schema: Mapping[str, Any], name: str, depth: int) -> str:
        if schema.get("contentMediaType") == "application/json":
            inner = schema.get("contentSchema", {})
            return json.dumps(self.value(inner, name, depth + 1))
        fmt = schema.get("format")
        text = self._formatted(fmt) if fmt else None
        if text is None:
            text = f"offline: {self.snippet} ({name})"
        low = int(schema.get("minLength", 0))
        high = schema.get("maxLength")
        text = _fit(text, low, high)
        pattern = schema.get("pattern")
        if pattern and not re.search(pattern, text):
            text = self._from_pattern(pattern, low, high, name)
        return text

    def _formatted(self, fmt: str) -> str | None:
        n = self.rng.randint(1, 250)
        moment = dt.datetime(2000, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
            seconds=self.rng.randint(0, 30 * 365 * 86400))
        formats = {
            "date-time": moment.isoformat().replace("+00:00", "Z"),
            "date": moment.date().isoformat(),
            "time": moment.time().isoformat(),
            "duration": f"PT{n}S",
            "email": f"offline{n}@example.com",
            "uri": f"https://example.com/offline/{n}",
            "url": f"https://example.com/offline/{n}",
            "iri": f"https://example.com/offline/{n}",
            "uri-reference": f"/offline/{n}",
            "uuid": str(uuid.UUID(int=self.rng.getrandbits(128), version=4)),
            "ipv4": f"192.0.2.{n}",
            "ipv6": f"2001:db8::{n:x}",
            "hostname": f"offline{n}.example.com",
        }
        return formats.get(fmt)

    def _from_pattern(self, pattern: str, low: int, high: int | None, name: str) -> str:
        try:
            parsed = _sre_parse.parse(pattern)
        except re.error as exc:
            raise SchemaUnsatisfiable(f"bad pattern {pattern!r} for {name!r}: {exc}") from None
        for _ in range(PATTERN_ATTEMPTS):
            groups: dict[int, str] = {}
            text = self._sample(parsed, groups)
            if re.search(pattern, text) and len(text) >= low and (high is None
                                                                    or len(text) <= high):
                return text
        raise SchemaUnsatisfiable(
            f"the offline backend cannot produce a string matching {pattern!r} for {name!r}"
        )

    def _sample(self, parsed: Any, groups: dict[int, str]) -> str:
        out: list[str] = []
        for op, av in parsed:
            kind = op.name
            if kind == "LITERAL":
                out.append(chr(av))
            elif kind == "NOT_LITERAL":
                out.append("a" if av != ord("a") else "b")
            elif kind == "ANY":
                out.append("x")
            elif kind == "IN":
                out.append(self._char_in(av))
            elif kind == "CATEGORY":
                out.append(_category_char(av.name))
            elif kind == "BRANCH":
                out.append(self._sample(self.rng.choice(av[1]), groups))
            elif kind == "SUBPATTERN":
                text = self._sample(av[-1], groups)
                if av[0] is not None:
                    groups[av[0]] = text
                out.append(text)
            elif kind == "ATOMIC_GROUP":
                out.append(self._sample(av, groups))
            elif kind in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                least, most, sub = av
                times = least + self.rng.randint(0, max(0, min(most, least + 3) - least))
                out.extend(self._sample(sub, groups) for _ in range(times))
            elif kind == "GROUPREF":
                out.append(groups.get(av, ""))
            # AT (anchors) and look-arounds produce nothing; the final re.search decides.
        return "".join(out)

    def _char_in(self, items: list[Any]) -> str:
        names = [op.name for op, _ in items]
        if names and names[0] == "NEGATE":
            banned = {chr(av) for op, av in items if op.name == "LITERAL"}
            for candidate in "aZ0 _-x.":
                if candidate not in banned and not any(
                    op.name == "RANGE" and av[0] <= ord(candidate) <= av[1]
                    for op, av in items
                ):
                    return candidate
            return "~"
        op, av = self.rng.choice(items)
        kind = op.name
        if kind == "LITERAL":
            return chr(av)
        if kind == "RANGE":
            return chr(self.rng.randint(av[0], av[1]))
        if kind == "CATEGORY":
            return _category_char(av.name)
        return "a"


def _category_char(category: str) -> str:
    return {
        "CATEGORY_DIGIT": "7",
        "CATEGORY_NOT_DIGIT": "a",
        "CATEGORY_SPACE": " ",
        "CATEGORY_NOT_SPACE": "a",
        "CATEGORY_WORD": "w",
        "CATEGORY_NOT_WORD": "-",
    }.get(category, "a")


def _fit(text: str, low: int, high: int | None) -> str:
    if len(text) < low:
        text = text + "." * (low - len(text))
    if high is not None and len(text) > high:
        text = text[: int(high)]
    return text


def _json_equal(a: Any, b: Any) -> bool:
    return canonical_json(a) == canonical_json(b)
