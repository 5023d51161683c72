"""Model backends: Ollama (the official client), offline (deterministic) and replay (recorded).

Every backend has a ``name`` and one method, ``chat(model, prompt, system, schema,
max_tokens, route=...) -> ModelReply``. This is the only module that imports ``ollama``.

- :class:`OllamaBackend` talks to an Ollama server (``[ollama] url``), and to a second one
  for the cloud route when ``[ollama] cloud_url`` is set. Unreachable servers and timeouts
  raise :class:`~runtime.errors.TransientModelError` (retried with backoff by the worker);
  a 404 raises :class:`~runtime.errors.ModelNotFound`.
- :class:`OfflineBackend` needs no network: schema-valid instances derived from a hash of
  the prompt, every string labelled ``offline:``.
- :class:`ReplayBackend` serves the responses of a recorded run from a JSONL file, keyed by
  the request (system + prompt + schema) and how many times that request came before.

:func:`build_backend` picks one from ``[llm] backend`` and says, in one sentence, which and
why (``auto``: Ollama if it answers within :data:`PROBE_TIMEOUT_SECONDS`, else offline).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import jsonschema
import ollama

from runtime.config import Settings
from runtime.errors import ModelNotFound, OrgchartError, TransientModelError
from runtime.llm.schema_instance import instance_for_schema, offline_text, prompt_snippet

log = logging.getLogger(__name__)

#: How long ``auto`` waits for Ollama to answer at start.
PROBE_TIMEOUT_SECONDS = 1.0
#: HTTP statuses from the model server that are worth retrying.
TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
#: Marks a model_calls prompt whose text was not kept (``[llm] record = false``).
NOT_RECORDED = "[not recorded]"


@dataclass(frozen=True)
class ModelReply:
    """What a backend answered.

    Attributes:
        text: the reply's text (the JSON text for structured output).
        data: the parsed JSON when a schema was given, else None.
        prompt_tokens: tokens the prompt took (as the server reported, or estimated).
        completion_tokens: tokens the reply took.
        duration_seconds: wall-clock time of the call.
        model: the model asked for.
        backend: ``"ollama"``, ``"offline"`` or ``"replay"``.
        offline: True when the content was made by the offline backend (also when it is
            replayed from a run recorded offline).

    """

    text: str
    data: Any | None
    prompt_tokens: int
    completion_tokens: int
    duration_seconds: float
    model: str
    backend: str
    offline: bool = False


class BadModelReply(OrgchartError):
    """The model's reply is not valid JSON for the requested schema (an agent failure)."""

    def __init__(self, message: str, reply: ModelReply | None = None) -> None:
        super().__init__(message)
        self.reply = reply


class ModelRequestError(OrgchartError):
    """The model server refused the request for a reason retrying will not fix."""


class ReplayMiss(OrgchartError):
    """The replay file has no response for this request (an agent failure)."""


class BackendConfigError(OrgchartError, ValueError):
    """``[llm]`` settings that cannot give a backend (for example replay without a file)."""


class Backend(Protocol):
    """What every model backend offers."""

    name: str

    def chat(self, model: str, prompt: str, system: str | None, schema: dict[str, Any] | None,
             max_tokens: int, *, route: str = "local") -> ModelReply:
        """Send one request and return the reply."""
        ...


# ---------------------------------------------------------------------- helpers
def estimate_tokens(text: str | None) -> int:
    """Estimate the tokens of ``text`` without a tokenizer (deterministic, conservative).

    The larger of words x 4/3 and characters / 4, so JSON without spaces is not undercounted.
    """
    if not text:
        return 0
    return max(round(len(text.split()) * 4 / 3), math.ceil(len(text) / 4), 1)


def schema_digest(schema: Mapping[str, Any]) -> str:
    """Return a short, stable hash of a JSON schema (canonical JSON)."""
    canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def request_text(prompt: str, system: str | None = None,
                 schema: Mapping[str, Any] | None = None) -> str:
    """Return the model-independent text of a request (stored in ``model_calls.prompt``).

    A bare prompt is stored as is; a system prompt and a schema add labelled sections
    (the schema as its title and a hash), so the stored text identifies the request.
    """
    if system is None and not schema:
        return prompt
    text = f"[system]\n{system}\n\n[user]\n{prompt}" if system is not None else prompt
    if schema:
        title = schema.get("title") or "schema"
        text += f"\n\n[format] json schema {title} sha256:{schema_digest(schema)}"
    return text


def request_key(prompt: str, system: str | None = None,
                schema: Mapping[str, Any] | None = None) -> str:
    """Return the replay key of a request: sha256 of :func:`request_text` (no model name)."""
    return hashlib.sha256(request_text(prompt, system, schema).encode()).hexdigest()


def parse_structured(text: str, schema: Mapping[str, Any], model: str) -> Any:
    """Parse a structured reply and check it against ``schema``.

    Raises:
        BadModelReply: the text is not JSON, or the JSON does not fit the schema.

    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadModelReply(
            f"model {model!r} was asked for JSON but replied with text that is not JSON "
            f"({exc.msg} at position {exc.pos}): {text[:200]!r}"
        ) from None
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise BadModelReply(
            f"the JSON reply of model {model!r} does not fit the schema at {where}: "
            f"{error.message}"
        )
    return data


# ---------------------------------------------------------------------- Ollama
class OllamaBackend:
    """Ollama through the official client; the cloud route may go to a second server."""

    name = "ollama"

    def __init__(self, url: str, timeout_seconds: float, cloud_url: str | None = None) -> None:
        self.url = url
        self.cloud_url = cloud_url or None
        self.timeout_seconds = timeout_seconds
        self._client = ollama.Client(host=url, timeout=timeout_seconds)
        self._cloud = (ollama.Client(host=cloud_url, timeout=timeout_seconds)
                       if self.cloud_url else None)

    @classmethod
    def from_settings(cls, settings: Settings) -> OllamaBackend:
        """Build from ``[ollama] url, timeout_seconds, cloud_url``."""
        o = settings.ollama
        return cls(o.url, o.timeout_seconds, o.cloud_url)

    def host_for(self, route: str) -> str:
        """Return the server a route's calls go to."""
        return self.cloud_url if route == "cloud" and self.cloud_url else self.url

    def chat(self, model: str, prompt: str, system: str | None, schema: dict[str, Any] | None,
             max_tokens: int, *, route: str = "local") -> ModelReply:
        """Call ``/api/chat`` once (no streaming).

        Raises:
            TransientModelError: the server is unreachable, timed out, or busy (5xx, 429).
            ModelNotFound: the server does not have ``model`` (404).
            ModelRequestError: any other refusal.
            BadModelReply: a schema was given and the reply does not fit it.

        """
        client = self._cloud if route == "cloud" and self._cloud is not None else self._client
        host = self.host_for(route)
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": prompt})
        started = time.monotonic()
        try:
            response = client.chat(model=model, messages=messages, format=schema or None,
                                   options={"num_predict": max_tokens}, stream=False)
        except ollama.ResponseError as exc:
            if exc.status_code == 404:
                raise ModelNotFound(model, f"{host} answered 404: {exc.error}") from exc
            if exc.status_code in TRANSIENT_STATUSES or exc.status_code < 0:
                raise TransientModelError(
                    f"model server {host} answered {exc.status_code} for {model!r}: {exc.error}"
                ) from exc
            raise ModelRequestError(
                f"model server {host} refused the request for {model!r} "
                f"(HTTP {exc.status_code}): {exc.error}"
            ) from exc
        except httpx.TimeoutException as exc:
            raise TransientModelError(
                f"model server {host} did not answer within {self.timeout_seconds} s "
                f"(ollama.timeout_seconds) for {model!r}"
            ) from exc
        except (httpx.TransportError, ConnectionError) as exc:
            raise TransientModelError(f"model server {host} is unreachable: {exc}") from exc
        duration = time.monotonic() - started
        text = response.message.content or ""
        # Ollama leaves prompt_eval_count out when the whole prompt was cached: estimate
        # rather than charge nothing.
        prompt_tokens = response.prompt_eval_count
        if prompt_tokens is None:
            prompt_tokens = estimate_tokens(system) + estimate_tokens(prompt)
        completion_tokens = response.eval_count
        if completion_tokens is None:
            completion_tokens = estimate_tokens(text)
        reply = ModelReply(text, None, int(prompt_tokens), int(completion_tokens), duration,
                           model, self.name)
        if schema:
            try:
                data = parse_structured(text, schema, model)
            except BadModelReply as exc:
                raise BadModelReply(str(exc), reply) from None
            reply = ModelReply(text, data, reply.prompt_tokens, reply.completion_tokens,
                               duration, model, self.name)
        return reply

    def probe(self, timeout: float = PROBE_TIMEOUT_SECONDS) -> bool:
        """Return True when the local server answers ``/api/tags`` within ``timeout``."""
        client = ollama.Client(host=self.url, timeout=timeout)
        try:
            client.list()
            return True
        except Exception as exc:  # any failure means "not usable now"
            log.debug("ollama probe failed", extra={"url": self.url, "error": str(exc)})
            return False
        finally:
            client.close()

    def close(self) -> None:
        """Close the HTTP connections."""
        self._client.close()
        if self._cloud is not None:
            self._cloud.close()


# ---------------------------------------------------------------------- offline
class OfflineBackend:
    """Deterministic answers with no network; everything it says is labelled offline."""

    name = "offline"

    def chat(self, model: str, prompt: str, system: str | None, schema: dict[str, Any] | None,
             max_tokens: int, *, route: str = "local") -> ModelReply:
        """Answer from a hash of the prompt: a schema-valid instance, or ``offline: ...``."""
        if schema:
            data = instance_for_schema(schema, prompt)
            text = json.dumps(data, ensure_ascii=False)
        else:
            data, text = None, offline_text(prompt)
        prompt_tokens = estimate_tokens(system) + estimate_tokens(prompt)
        completion_tokens = min(estimate_tokens(text), max(int(max_tokens), 0))
        return ModelReply(text, data, prompt_tokens, completion_tokens, 0.0, model, self.name,
                          offline=True)


# ---------------------------------------------------------------------- replay
@dataclass(frozen=True)
class ReplayRecord:
    """One recorded response (one line of a replay file)."""

    key: str
    occurrence: int
    prompt: str
    response: str
    data: Any
    prompt_tokens: int
    completion_tokens: int
    model: str
    route: str
    backend: str = ""

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object written on the record's line."""
        return {"key": self.key, "occurrence": self.occurrence, "prompt": self.prompt,
                "response": self.response, "data": self.data,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "model": self.model,
                "route": self.route, "backend": self.backend}


_RECORD_FIELDS = ("key", "prompt", "response", "prompt_tokens", "completion_tokens", "model",
                  "route")


def records_from_calls(calls: Iterable[Mapping[str, Any]]) -> list[ReplayRecord]:
    """Turn ``model_calls`` rows (oldest first) into replay records.

    Failed calls and calls whose text was not kept are skipped: a replayed run never sees
    the transient failures of the recorded one.
    """
    seen: dict[str, int] = defaultdict(int)
    records = []
    for call in calls:
        prompt, response = call.get("prompt"), call.get("response")
        if call.get("error") or response is None or prompt is None:
            continue
        if prompt.startswith(NOT_RECORDED):
            continue
        key = hashlib.sha256(prompt.encode()).hexdigest()
        data = None
        if "\n\n[format] json schema " in prompt:
            try:
                data = json.loads(response)
            except json.JSONDecodeError:
                continue
        records.append(ReplayRecord(key, seen[key], prompt, response, data,
                                    int(call.get("prompt_tokens") or 0),
                                    int(call.get("completion_tokens") or 0),
                                    str(call.get("model") or ""), str(call.get("route") or ""),
                                    str(call.get("backend") or "")))
        seen[key] += 1
    return records


def write_replay_file(path: str | Path, records: Iterable[ReplayRecord]) -> int:
    """Write records as JSONL; return how many lines were written."""
    count = 0
    with Path(path).open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record.to_json(), ensure_ascii=False, sort_keys=True) + "\n")
            count += 1
    return count


def load_replay_file(path: str | Path) -> dict[str, list[ReplayRecord]]:
    """Read a replay file into ``{key: [records in occurrence order]}``.

    Raises:
        BackendConfigError: the file is missing or a line is malformed (line number named).

    """
    file = Path(path)
    if not file.is_file():
        raise BackendConfigError(f"replay file {file} does not exist (llm.replay_file)")
    by_key: dict[str, list[ReplayRecord]] = defaultdict(list)
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BackendConfigError(f"{file}:{number}: not JSON ({exc.msg})") from None
        missing = [f for f in _RECORD_FIELDS if not isinstance(raw, dict) or f not in raw]
        if missing:
            raise BackendConfigError(f"{file}:{number}: missing {', '.join(missing)}")
        records = by_key[raw["key"]]
        records.append(ReplayRecord(
            raw["key"], int(raw.get("occurrence", len(records))), raw["prompt"],
            raw["response"], raw.get("data"), int(raw["prompt_tokens"]),
            int(raw["completion_tokens"]), raw["model"], raw["route"],
            str(raw.get("backend") or "")))
    for records in by_key.values():
        records.sort(key=lambda r: r.occurrence)
    return dict(by_key)


class ReplayBackend:
    """Serves a recorded run's responses, the same ones in the same order.

    The n-th time a request is made it gets the n-th recorded response to that request;
    past the last one it gets the last one again. A request never recorded raises
    :class:`ReplayMiss`.
    """

    name = "replay"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._records = load_replay_file(self.path)
        self._served: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    @property
    def offline(self) -> bool:
        """True when every recorded response was made by the offline backend."""
        records = [r for rs in self._records.values() for r in rs]
        return bool(records) and all(r.backend == OfflineBackend.name for r in records)

    @property
    def size(self) -> int:
        """How many responses the file holds."""
        return sum(len(r) for r in self._records.values())

    def chat(self, model: str, prompt: str, system: str | None, schema: dict[str, Any] | None,
             max_tokens: int, *, route: str = "local") -> ModelReply:
        """Return the recorded response to this request.

        Raises:
            ReplayMiss: the request is not in the file.
            BadModelReply: a schema was given and the recorded text does not fit it.

        """
        key = request_key(prompt, system, schema)
        records = self._records.get(key)
        if not records:
            raise ReplayMiss(
                f"replay: no recorded response in {self.path} for the prompt "
                f"{prompt_snippet(prompt, 16)!r} (request key {key[:12]}); record the run "
                "again with 'orgchart llm record ROOT_ID --out FILE' or use another "
                "llm.backend"
            )
        with self._lock:
            occurrence = self._served[key]
            self._served[key] += 1
        record = records[min(occurrence, len(records) - 1)]
        data = record.data
        if schema and data is None:
            data = parse_structured(record.response, schema, model)
        return ModelReply(record.response, data, record.prompt_tokens,
                          record.completion_tokens, 0.0, model, self.name,
                          offline=record.backend == OfflineBackend.name)


# ---------------------------------------------------------------------- choice
def build_backend(settings: Settings,
                  probe_timeout: float = PROBE_TIMEOUT_SECONDS) -> tuple[Backend, str]:
    """Build the backend ``[llm] backend`` asks for; return it and a sentence saying why.

    Raises:
        BackendConfigError: ``replay`` without a readable ``[llm] replay_file``.

    """
    choice = settings.llm.backend
    if choice == "offline":
        return OfflineBackend(), (
            "using the offline backend (llm.backend = 'offline'): deterministic answers, "
            "labelled offline, no network")
    if choice == "replay":
        if not settings.llm.replay_file:
            raise BackendConfigError(
                "llm.backend = 'replay' needs llm.replay_file (or ORGCHART_LLM__REPLAY_FILE)"
                "; write one with 'orgchart llm record ROOT_ID --out FILE'")
        replay = ReplayBackend(settings.llm.replay_file)
        source = " (recorded with the offline backend)" if replay.offline else ""
        return replay, (f"replaying {replay.size} recorded responses from {replay.path}"
                        f"{source} (llm.backend = 'replay')")
    backend = OllamaBackend.from_settings(settings)
    cloud = (f"; the cloud route goes to {backend.cloud_url}" if backend.cloud_url else "")
    if choice == "ollama":
        up = backend.probe(probe_timeout)
        note = "" if up else ("; it does not answer now, so calls fail as transient errors "
                              "and are retried until it does")
        return backend, f"using Ollama at {backend.url} (llm.backend = 'ollama'){cloud}{note}"
    if backend.probe(probe_timeout):
        return backend, (f"Ollama answered at {backend.url}; using it "
                         f"(llm.backend = 'auto'){cloud}")
    backend.close()
    return OfflineBackend(), (
        f"no Ollama answered at {backend.url}; using the offline backend "
        "(deterministic, labelled offline)")
