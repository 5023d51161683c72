"""The replay backend: a recorded run's responses, served again from a JSONL file.

``orgchart llm record ROOT_ID --out FILE`` writes the successful ``model_calls`` of a tree
(:func:`records_from_calls`, :func:`write_replay_file`); :class:`ReplayBackend` serves them
keyed by the request (system + prompt + schema) and how many times that request came
before.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.llm.backends.offline import OfflineBackend
from runtime.llm.backends.schema_instance import prompt_snippet
from runtime.llm.reply import (
    NOT_RECORDED,
    Backend,
    BackendConfigError,
    Message,
    ModelReply,
    ReplayMiss,
    checked_reply,
    request_key,
    request_text,
    split_messages,
)
from runtime.llm.text_stream import text_in_pieces
from runtime.llm.tool_loop import ToolRound, recorded_tool_calls, round_note


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
    #: A tool round's calls (``[{"id", "name", "arguments"}]``), else None.
    tool_calls: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object written on the record's line."""
        return {"key": self.key, "occurrence": self.occurrence, "prompt": self.prompt,
                "response": self.response, "data": self.data,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "model": self.model,
                "route": self.route, "backend": self.backend, "tool_calls": self.tool_calls}


_RECORD_FIELDS = ("key", "prompt", "response", "prompt_tokens", "completion_tokens", "model",
                  "route")


def records_from_calls(calls: Iterable[Mapping[str, Any]]) -> list[ReplayRecord]:
    """Turn ``model_calls`` rows (oldest first) into replay records.

    Failed calls, calls whose text was not kept and calls served from the record of an
    earlier delivery (``replayed``) are skipped: a replayed run never sees the transient
    failures or the repairs of the recorded one.
    """
    seen: dict[str, int] = defaultdict(int)
    records = []
    for call in calls:
        prompt, response = call.get("prompt"), call.get("response")
        if call.get("error") or call.get("replayed") or response is None or prompt is None:
            continue
        if prompt.startswith(NOT_RECORDED):
            continue
        key = hashlib.sha256(prompt.encode()).hexdigest()
        data = None
        tool_calls = call.get("tool_calls")
        if "\n\n[format] json schema " in prompt and not tool_calls:
            try:
                data = json.loads(response)
            except json.JSONDecodeError:
                continue
        records.append(ReplayRecord(key, seen[key], prompt, response, data,
                                    int(call.get("prompt_tokens") or 0),
                                    int(call.get("completion_tokens") or 0),
                                    str(call.get("model") or ""), str(call.get("route") or ""),
                                    str(call.get("backend") or ""), tool_calls))
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
            str(raw.get("backend") or ""), raw.get("tool_calls")))
    for records in by_key.values():
        records.sort(key=lambda r: r.occurrence)
    return dict(by_key)


class ReplayBackend(Backend):
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

    async def achat(self, model: str, messages: Sequence[Message],
                    schema: dict[str, Any] | None, max_tokens: int, *,
                    route: str = "local", think: bool = False,
                    tools: Sequence[dict[str, Any]] = ()) -> ModelReply:
        """Return the recorded response to the conversation's first prompt (see :meth:`chat`).

        A round of a tool loop (``tools`` given) is keyed as it was stored: the request's
        text plus the round's note (the tools, the round, the conversation's hash), and
        gets the recorded tool calls back.
        """
        prompt, system = split_messages(messages)
        if not tools:
            return self.chat(model, prompt, system, schema, max_tokens, route=route)
        number = sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))
        text = request_text(prompt, system, schema) + round_note(
            ToolRound(list(messages), list(tools), number))
        record = self._next(hashlib.sha256(text.encode()).hexdigest(), prompt)
        calls = recorded_tool_calls(record.tool_calls)
        text_in_pieces(record.response)
        reply = ModelReply(record.response, None, record.prompt_tokens,
                           record.completion_tokens, 0.0, model, self.name,
                           offline=record.backend == OfflineBackend.name, tool_calls=calls)
        return checked_reply(reply, schema)

    def chat(self, model: str, prompt: str, system: str | None, schema: dict[str, Any] | None,
             max_tokens: int, *, route: str = "local", think: bool = False) -> ModelReply:
        """Return the recorded response to this request.

        Raises:
            ReplayMiss: the request is not in the file.
            BadModelReply: a schema was given and the recorded text does not fit it.

        """
        record = self._next(request_key(prompt, system, schema), prompt)
        text_in_pieces(record.response)  # streamed word by word, as it was made
        reply = ModelReply(record.response, None, record.prompt_tokens,
                           record.completion_tokens, 0.0, model, self.name,
                           offline=record.backend == OfflineBackend.name)
        if schema and record.data is not None:
            return ModelReply(record.response, record.data, record.prompt_tokens,
                              record.completion_tokens, 0.0, model, self.name,
                              offline=reply.offline)
        return checked_reply(reply, schema)

    def _next(self, key: str, prompt: str) -> ReplayRecord:
        """The next recorded response to the request keyed ``key`` (the last one again)."""
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
        return records[min(occurrence, len(records) - 1)]
