"""JSON on the worker's hot path: orjson, with the standard library's answer as the rule.

A claim reads each task's ``payload`` (``jsonb``) and a batched write sends its outcomes as
one JSON document. With the standard ``json`` module, encoding alone was 13 % of the
worker's CPU in a no-op drain (``py-spy``); orjson does the same work in a fraction of it.

The values must not change with the codec, so orjson is used only where it gives what
``json`` gives, and ``json`` answers the rest:

- :func:`loads_fast`: orjson reads an integer above 64 bits as a float (a lost digit);
  a document with 19 or more digits in a row goes to ``json.loads``, as does anything
  orjson refuses (``1e400``, which ``json`` reads as infinity).
- :func:`dumps_fast`: datetimes and dataclasses pass to ``default=str`` as ``json``
  sends them (orjson would write ISO ``T`` times and dataclass fields); whatever orjson
  cannot write (an integer above 64 bits, a non-string key, a lone surrogate) is
  written by ``json.dumps``. One difference is kept on purpose: a NaN or an infinity
  is written as ``null`` by orjson, where ``json`` writes a token PostgreSQL refuses
  (the whole batch failed with it).

Hashes and stored canonical forms (:func:`runtime.store.rows.canonical_json`) stay on
``json``: they must never change.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
#: An integer orjson may read as a float (above 2**64 - 1 or below -2**63).
_LONG_DIGITS = re.compile(rb"\d{19}")


def loads_fast(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON as ``json.loads`` does (the ``jsonb`` loader of the store's engines)."""
    raw = data.encode() if isinstance(data, str) else data
    if _LONG_DIGITS.search(raw) is None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(bytes(raw))


def dumps_fast(value: Any) -> str:
    """Compact JSON for a batch parameter, as ``json.dumps(default=str)`` would send it."""
    try:
        return orjson.dumps(value, default=str, option=_OPTIONS).decode()
    except TypeError:
        return json.dumps(value, separators=(",", ":"), default=str)
