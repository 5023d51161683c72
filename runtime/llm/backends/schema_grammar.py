"""The grammar is the schema: llguidance's token masks hold the embedded model to a JSON schema.

llama.cpp's own JSON-schema converter unrolls a string length into one rule per character
(the CEO's ``Plan``, whose ``brief`` allows 1500 characters, crashed its grammar parser),
so the embedded backend used to hold replies to a *relaxed* schema without lengths: the
model could write ``summary: ''`` that the schema then refused. llguidance (the
``llguidance`` package, part of the ``embedded`` extra) compiles the *whole* schema
(string lengths, item counts, required fields, enums, ``anyOf``, ``$ref``) into a lexer
and an Earley parser over the model's own vocabulary, and computes the set of tokens
allowed next in tens of microseconds, so a reply that fits the grammar fits the schema.

- :class:`SchemaGrammars`: one per loaded model: the vocabulary as llguidance sees it
  (built once, about a second for a 49k vocabulary) and one compiled matcher per schema.
- :class:`GrammarMask`: one per generation, a llama-cpp-python logits processor: before
  each token it feeds the matcher the tokens generated since the last one and sets every
  token the grammar does not allow to ``-inf``. Once the JSON is complete only the end of
  sequence is allowed.

Replies are compact JSON with ``", "`` and ``": "`` between items (no free whitespace: a
small model allowed it writes newlines until the token limit).

This module and ``embedded.py`` are the only ones that import ``llama_cpp``; this one is
the only one that imports ``llguidance``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import threading
from collections.abc import Mapping
from typing import Any

from runtime.llm.reply import ModelRequestError, schema_digest

#: How the JSON is laid out: one space after separators, no other whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Longest token piece (bytes) read from the vocabulary.
_PIECE_BUFFER = 16 * 1024
#: Keywords whose value is a map of name -> subschema, a list of them, or one.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains")


def guidance_installed() -> bool:
    """True when ``llguidance`` can be imported (part of the ``embedded`` extra)."""
    return importlib.util.find_spec("llguidance") is not None


def closed_schema(schema: Any) -> Any:
    """A copy of ``schema`` whose objects with ``properties`` allow no other keys.

    JSON Schema allows unnamed keys unless ``additionalProperties`` says otherwise, and
    pydantic's schemas do not say (pydantic ignores extra keys): held to the schema as it
    is, a small model spends its tokens on keys nobody reads. An object that sets
    ``additionalProperties`` itself keeps it. Only a schema's keywords are read: a
    property *named* ``properties`` is a property.
    """
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {name: closed_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [closed_schema(sub) for sub in value]
        elif key in _SCHEMA_ONE:
            out[key] = closed_schema(value)
        else:
            out[key] = value
    if isinstance(out.get("properties"), Mapping) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(schema: Mapping[str, Any], tokenizer: Any = None) -> str:
    """The grammar llguidance compiles from ``schema`` (:func:`closed_schema`), checked.

    A schema with a keyword llguidance does not implement (a ``format`` it does not know)
    is compiled again without that keyword (llguidance's ``lenient``): the reply is still
    checked against the whole schema after, and repaired if it breaks that keyword.

    Raises:
        ModelRequestError: llguidance refuses the schema even so (the message says why).

    """
    from llguidance import LLMatcher

    text = json.dumps(closed_schema(schema))
    errors = []
    for lenient in (False, True):
        try:
            grammar = LLMatcher.grammar_from_json_schema(
                text, overrides={**JSON_OPTIONS, "lenient": lenient})  # type: ignore[arg-type]
        except ValueError as exc:
            grammar, error = "", str(exc)
        else:
            error = LLMatcher.validate_grammar(grammar, tokenizer)
        if not error or error.startswith("WARNING"):
            return grammar
        errors.append(error)
    raise ModelRequestError(f"the schema {schema.get('title') or schema_digest(schema)} "
                            f"has no grammar: {errors[0]}")


def _tokenizer(vocab: Any) -> Any:
    """An ``LLTokenizer`` over a llama.cpp vocabulary (its tokenizer runs in llama.cpp).

    What ``llguidance.llamacpp.lltokenizer_from_vocab`` does, with the vocabulary calls
    that are not deprecated in llama-cpp-python 0.3.36 (the deprecated one warns on each
    of the 49k tokens). Control tokens are prefixed with ``0xff``: llguidance's mark of a
    special token, which a grammar never allows inside a string.
    """
    import llama_cpp
    from llguidance import LLTokenizer

    buffer = ctypes.create_string_buffer(_PIECE_BUFFER + 1)
    pieces: list[bytes] = []
    for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        n = llama_cpp.llama_token_to_piece(vocab, token, buffer, _PIECE_BUFFER, 0, True)
        if n < 0:
            raise ModelRequestError(f"token {token} does not fit {_PIECE_BUFFER} bytes")
        piece = buffer.raw[:n]
        attr = llama_cpp.llama_vocab_get_attr(vocab, token)
        if attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL or (
                attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
                and piece.startswith(b"<") and piece.endswith(b">")):
            piece = b"\xff" + piece
        pieces.append(piece)
    tokenize = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=pieces, vocab_ptr=vocab, tokenize_fptr=tokenize,
        eos_token=llama_cpp.llama_vocab_eos(vocab), slices=None)


class GrammarMask:
    """A logits processor holding one generation to a compiled schema.

    llama-cpp-python calls it before sampling each token with every token evaluated so
    far (the prompt, then the reply) and the logits; the first call marks where the reply
    starts. Should the matcher ever refuse a token or allow none, only the end of the
    reply is allowed: the reply ends there and its check says what is wrong.
    """

    def __init__(self, matcher: Any, n_vocab: int, eos: int) -> None:
        # numpy comes with the embedded extra (llama-cpp-python's dependency), not with the
        # package: imported here, so that choosing a backend never needs it.
        import numpy as np

        self._np = np
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.eos = eos
        self._words = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self._start: int | None = None
        self._fed = 0

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        """Return ``scores`` with the tokens the grammar does not allow next at ``-inf``."""
        np = self._np
        if self._start is None:
            self._start = len(input_ids)
        new = input_ids[self._start + self._fed:]
        if len(new):
            self.matcher.consume_tokens([int(t) for t in new])
            self._fed += len(new)
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:len(scores)]
        if self.matcher.is_error() or not allowed.any():
            allowed[:] = 0
            allowed[self.eos] = 1
        return np.where(allowed.astype(bool), scores, -np.inf).astype(scores.dtype)

    def accepts(self, tokens: list[int]) -> bool:
        """True when ``tokens`` are a whole reply the grammar allows (this mask unchanged)."""
        matcher = self.matcher.deep_copy()
        return bool(matcher.try_consume_tokens(tokens) == len(tokens)
                    and matcher.is_accepting())

    @property
    def error(self) -> str:
        """Why the matcher refused a token ('' when it never did)."""
        return str(self.matcher.get_error() or "")


class SchemaGrammars:
    """One model's vocabulary for llguidance and its compiled schemas (thread-safe)."""

    def __init__(self, vocab: Any) -> None:
        import llama_cpp

        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(vocab))
        self.tokenizer = _tokenizer(vocab)
        self._matchers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def mask(self, schema: Mapping[str, Any]) -> GrammarMask:
        """A fresh :class:`GrammarMask` of ``schema`` for one generation.

        Raises:
            ModelRequestError: llguidance refuses the schema (the message says why).

        """
        key = schema_digest(schema)
        with self._lock:
            matcher = self._matchers.get(key) or self._compile(key, schema)
            return GrammarMask(matcher.deep_copy(), self.n_vocab, self.eos)

    def _compile(self, key: str, schema: Mapping[str, Any]) -> Any:
        """Compile ``schema`` into a matcher in its start state and keep it under ``key``."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar_text(schema, self.tokenizer), log_level=0)
        self._matchers[key] = matcher
        return matcher
