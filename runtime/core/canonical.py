"""Canonical JSON and its hash: the durable identity of what the runtime stores.

Request hashes (the record key of a model call), schema digests, a step's arguments,
a dataset's version and the store's JSON parameters are all :func:`canonical_json`
(sorted keys, no spaces, ASCII only, anything else written as ``str(value)``). These
hashes are stored: a byte that changes here breaks replay silently, so
``tests/unit/test_core_canonical.py`` pins the output for fixed inputs.

:func:`canonical_json_spaced` is the older form with ``json``'s default separators
(``", "`` and ``": "``). Two stored or seeding uses were written with it and keep it:
the conversation hash of a tool round in the stored prompt (``model_calls.prompt``) and
the seed of the offline backend's answer to a schema. New uses take :func:`canonical_json`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: One encoder made once (``json.dumps`` with options builds one per call); its output
#: is ``json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)``.
_COMPACT = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str).encode
#: ``json.dumps(value, sort_keys=True, default=str)``.
_SPACED = json.JSONEncoder(sort_keys=True, default=str).encode


def canonical_json(value: Any) -> str:
    """Stable JSON for hashing and storing: sorted keys, no spaces, ``str`` for the rest."""
    return _COMPACT(value)


def canonical_sha256(value: Any) -> str:
    """The sha256 (hex) of :func:`canonical_json` of ``value``."""
    return sha256_hex(_COMPACT(value))


def canonical_json_spaced(value: Any) -> str:
    """The older canonical form, with spaces after ``,`` and ``:`` (see the module's note)."""
    return _SPACED(value)


def sha256_hex(text: str) -> str:
    """The sha256 (hex) of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode()).hexdigest()
