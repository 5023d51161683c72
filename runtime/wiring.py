"""Wiring: settings -> store, registry, policies, model backend, executor, worker.

Every entry point (CLI, HTTP API, orchestrator, tests) builds its parts here so that
they agree on what "the configured runtime" is.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from agents.loader import load_modules
from agents.registry import Registry
from runtime.config import Settings
from runtime.constants import (
    DEFAULT_BUDGET_SECONDS,
    DEFAULT_BUDGET_TOKENS,
    DEFAULT_BUDGET_USD,
    DEFAULT_TENANT,
    TENANT_NAME_PATTERN,
)
from runtime.core.dberrors import one_line
from runtime.errors import BadInput
from runtime.store.postgres import failover, retry
from runtime.store.postgres.engines import create_db_engine
from runtime.store.postgres.failover import DatabaseUnavailable
from runtime.store.postgres.migrations import ensure_schema
from runtime.store.postgres.urls import ConnectionOptions, redacted, settled_url
from runtime.store.queries import Task
from runtime.store.rows import HUMAN_AGENT, NewTask, NotFound, Tenancy
from runtime.store.store import Store

log = logging.getLogger(__name__)

#: A root goal larger than this is refused before anything is written.
MAX_GOAL_CHARS = 100_000


def open_store(settings: Settings, migrate: bool = True, ride_out: bool = True) -> Store:
    """Resolve the database (embedded if none is named), migrate it, and open a Store.

    With ``ride_out`` (workers, ``serve``, ``submit``, ``run``, ``fork``, ``fire``),
    while the database fails over, the schema check is retried for up to ``[database]
    failover_timeout_seconds``; without it (the commands that read or steer, which a
    person runs and can run again), a database that does not answer fails at once.
    """
    url = settled_url(settings.database.url)
    engine = create_db_engine(url, pool_size=settings.database.pool_size,
                              statement_timeout_ms=settings.database.statement_timeout_ms,
                              options=ConnectionOptions.from_settings(settings.database))
    if migrate:
        # Through the store's pool: the connection that asks stays for the work (a
        # connection and an engine of its own were part of every worker's start-up).
        try:
            retry.retry(lambda: ensure_schema(url, engine),
                     settings.database.failover_timeout_seconds if ride_out else 0.0)
        except BaseException:
            engine.dispose()
            raise
    store = Store(engine)
    store.policies.tenancy = Tenancy.from_settings(settings)
    from policies.approval import holds  # not at import time: the CLI loads this early

    store.policies.approval_agents, store.policies.approve_above_usd = holds(settings)
    return store


def load_registry(settings: Settings, extra_modules: Sequence[str] = ()) -> Registry:
    """The built-in org plus user agent modules from config and the command line."""
    return load_modules([*settings.agents.modules, *extra_modules])


@dataclass
class Runtime:
    """The configured parts, built once per process."""

    settings: Settings
    store: Store
    registry: Registry
    policies: Any
    llm_factory: Any
    #: The MCP tools of ``[mcp]`` (``runtime.llm.mcp_tools.McpToolSource``).
    tool_source: Any = None

    def executor(self) -> Any:
        """An executor over these parts."""
        from runtime.engine.executor import Executor
        from runtime.engine.judge_stage import judge_task

        tools_for = self.tool_source.tools_for if self.tool_source is not None else None
        return Executor(store=self.store, registry=self.registry, settings=self.settings,
                        policies=self.policies, llm_factory=self.llm_factory, judge=judge_task,
                        tools_for=tools_for)

    def worker(self, agents: Sequence[str] | None = None, **overrides: Any) -> Any:
        """A worker for ``agents`` (default: every registered agent plus the judge stage)."""
        from runtime.engine.worker import Worker, WorkerConfig

        # A person answers 'human' tasks: no worker serves that agent by default.
        names = tuple(agents) if agents else tuple(n for n in self.registry.names()
                                                   if n != HUMAN_AGENT)
        for name in names:
            self.registry.get(name)  # unknown names fail here, with a suggestion
        config = WorkerConfig.from_settings(self.settings, names, **overrides)
        from runtime.telemetry.traces import start_trace_export

        start_trace_export(self.store)  # OTLP traces, only when OTEL_EXPORTER_OTLP_* is set
        from runtime.webhooks import start_delivery

        start_delivery(self.store, self.settings)  # the outbox, when an endpoint is subscribed
        failover.OUTAGE.level = logging.WARNING  # a long-running process: say so in the log
        return Worker(self.store, self.executor(), config)


def build_runtime(settings: Settings, extra_modules: Sequence[str] = (),
                  store: Store | None = None) -> Runtime:
    """Build every part from ``settings`` (the model backend is probed here for ``auto``).

    A worker attaches its event loop to the model layer while it runs
    (``LLMFactory.attach``); outside one, the model layer runs its own loop thread.
    """
    from policies.loader import load_policy_set
    from runtime.engine.charges import ChargeWriter
    from runtime.engine.store_ledger import StoreLedger
    from runtime.engine.text_writer import TextWriter
    from runtime.llm.handle import LLMFactory

    registry = load_registry(settings, extra_modules)
    store = store or open_store(settings)
    policies = load_policy_set(settings, registry, extra_modules)
    from policies.approval import holds

    # A store given by the caller gets the rule's settings too (open_store sets its own).
    store.policies.approval_agents, store.policies.approve_above_usd = holds(settings)
    # Model-call charges are batched (ChargeWriter): what arrives within a few ms is one
    # statement, each call still guarded by its task's lease token.
    # Streamed text (issue 47) is group-committed too, one row per call per batch.
    text = (TextWriter(store, settings.streaming.flush_seconds,
                       settings.streaming.flush_chars)
            if settings.streaming.enabled else None)
    llm_factory = LLMFactory(settings, StoreLedger(store, ChargeWriter(store)), text=text)
    return Runtime(settings, store, registry, policies, llm_factory,
                   mcp_tool_source(settings, registry))


def mcp_tool_source(settings: Settings, registry: Registry) -> Any:
    """The ``[mcp]`` servers' tools (started on first use), or None when none is configured.

    Raises:
        UnknownAgent: a server names an agent that is not registered (with a suggestion).

    """
    if not settings.mcp.servers:
        return None
    for server in settings.mcp.servers.values():
        for agent in server.agents:
            registry.get(agent)
    import atexit

    from runtime.llm.mcp_tools import McpToolSource

    source = McpToolSource(settings)
    atexit.register(source.close)
    return source


# ---------------------------------------------------------------------- submission
def submit_root(store: Store, new: NewTask, actor: str, timeout: float) -> tuple[Task, bool]:
    """Submit ``new`` riding out a failover: the root exists once, or an error says why.

    The root's id is chosen here, so when an attempt fails (its COMMIT may have landed:
    the connection broke after it was sent) the next attempt first looks that id up and
    returns the task if it is there; only then does it insert again. An idempotency key
    does the same across processes. After ``timeout`` seconds of failover errors it
    raises :class:`DatabaseUnavailable` naming the outage (one line for the CLI).
    """
    task_id = uuid.uuid4()
    failed = False

    def attempt() -> tuple[Task, bool]:
        nonlocal failed
        if failed:
            try:
                return store.reads.get(task_id), True
            except NotFound:
                pass
        try:
            return store.tasks.submit(new, actor=actor, task_id=task_id)
        except Exception:
            failed = True
            raise

    try:
        return retry.retry(attempt, timeout)
    except Exception as exc:
        if not failover.is_failover_error(exc):
            raise
        raise DatabaseUnavailable(
            f"the database at {redacted(str(store.engine.url))} is unreachable or failing "
            f"over; nothing was submitted (gave up after {timeout:g}s): {one_line(exc, 200)}"
        ) from exc


def parse_json_option(name: str, text: str | None) -> Any:
    """Parse a JSON command-line option; malformed JSON is a :class:`BadInput` naming it."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{name} is not valid JSON: {exc.msg} at line {exc.lineno} "
                       f"column {exc.colno}") from None


def _checked_budget(budget_tokens: int, budget_seconds: int, budget_usd: Decimal | float | str,
                    priority: int) -> Decimal:
    """A root's budget in dollars, once its budgets and priority are known to fit the schema.

    Raises:
        BadInput: a budget is not a number, negative, too large, or no seconds at all; or
            the priority is out of range.

    """
    try:
        usd = Decimal(str(budget_usd))
    except InvalidOperation:
        raise BadInput(f"budget_usd {budget_usd!r} is not a number") from None
    for name, value in (("budget_tokens", budget_tokens), ("budget_seconds", budget_seconds),
                        ("budget_usd", usd)):
        if value < 0:
            raise BadInput(f"{name} cannot be negative (got {value})")
    if budget_tokens > 2**31 - 1 or budget_seconds > 2**31 - 1 or usd >= Decimal("1000000"):
        raise BadInput("a budget is larger than the schema can hold")
    if budget_seconds == 0:
        raise BadInput("budget_seconds must be at least 1")
    if not -1000 <= priority <= 1000:
        raise BadInput(f"priority must be between -1000 and 1000 (got {priority})")
    return usd


def build_root(registry: Registry, settings: Settings, *, goal: str | None, agent: str = "ceo",
               type_: str | None = None, priority: int = 5,
               budget_tokens: int = DEFAULT_BUDGET_TOKENS,
               budget_seconds: int = DEFAULT_BUDGET_SECONDS,
               budget_usd: Decimal | float | str = DEFAULT_BUDGET_USD,
               payload: dict[str, Any] | None = None, success: Any = None, kill: Any = None,
               idempotency_key: str | None = None,
               tenant: str = DEFAULT_TENANT) -> NewTask:
    """Validate a root goal and return the task to insert; raise :class:`BadInput` if bad.

    Checks, before anything is written: the agent exists, the goal is not blank nor too
    long, the payload matches its input schema, its size is within ``[policies]
    max_payload_bytes``, budgets are sane, and the success and kill criteria are well
    formed.
    """
    from agents.registry import InvalidInput, UnknownAgent
    from policies.builtin import payload_bytes
    from policies.criteria import validate_criteria

    try:
        cls = registry.get(agent)
    except UnknownAgent as exc:
        raise BadInput(str(exc)) from None
    if goal is not None and len(goal) > MAX_GOAL_CHARS:
        raise BadInput(f"the goal is {len(goal)} characters; the limit is {MAX_GOAL_CHARS}")
    if goal is not None and not goal.strip():  # "   " would run a whole tree on nothing
        raise BadInput("the goal is blank: say what the tree should do")
    if payload is not None and not isinstance(payload, dict):
        raise BadInput("--payload must be a JSON object")
    body: dict[str, Any] = dict(payload or {})
    if goal is not None:
        body.setdefault("goal", goal)
    check_storable(body, "the payload")
    check_storable(success, "--success")
    check_storable(kill, "--kill")
    if idempotency_key is not None:
        check_storable(idempotency_key, "the idempotency key")
    size = payload_bytes(body)  # the measure the max_payload_bytes rule uses
    limit = settings.policies.max_payload_bytes
    if size > limit:
        raise BadInput(f"the payload is {size} bytes; [policies] max_payload_bytes is {limit}")
    try:
        registry.validate_input(agent, body)
    except InvalidInput as exc:
        raise BadInput(str(exc)) from None
    usd = _checked_budget(budget_tokens, budget_seconds, budget_usd, priority)
    validate_criteria(success, kill)
    if type_ is not None and type_ not in cls.types:
        raise BadInput(f"agent {agent!r} handles types {list(cls.types)}, not {type_!r}")
    if idempotency_key is not None and not 1 <= len(idempotency_key) <= 200:
        raise BadInput("an idempotency key must be 1 to 200 characters")
    if not isinstance(tenant, str) or not re.match(TENANT_NAME_PATTERN, tenant):
        raise BadInput(f"bad tenant {tenant!r}: letters, digits, '_', '.', '-' "
                       "(at most 64, starting with a letter or digit)")
    return NewTask(
        to_agent=agent, type=type_ or cls.types[0], payload=body, priority=priority,
        budget_tokens=budget_tokens, budget_seconds=budget_seconds, budget_usd=usd,
        success_criteria=success, kill_criteria=kill, idempotency_key=idempotency_key,
        tenant=tenant,
    )


def check_storable(value: Any, where: str) -> None:
    """Refuse what PostgreSQL cannot store: NUL characters, lone surrogates, NaN/Infinity.

    Raises:
        BadInput: naming where in the value the problem is.

    """
    if isinstance(value, str):
        if "\x00" in value:
            raise BadInput(f"{where} contains a NUL character (\\u0000), which PostgreSQL "
                           "cannot store")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadInput(f"{where} is not valid Unicode (a lone surrogate)") from None
    elif isinstance(value, float) and not math.isfinite(value):
        raise BadInput(f"{where} holds {value}, which JSON cannot carry")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_storable(key, f"{where} (a key)")
            check_storable(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_storable(item, f"{where}[{i}]")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> dt.timedelta:
    """Parse ``30s``, ``15m``, ``12h``, ``7d``, ``2w``; raise :class:`BadInput` otherwise."""
    m = _DURATION.match(text)
    if not m:
        raise BadInput(f"cannot read duration {text!r}: use a number and s, m, h, d or w "
                       "(e.g. 7d)")
    return dt.timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])
