"""The slot stage: a request's turn at its server, in fair order, within its tenant's tokens.

Each route's server takes at most ``[ollama] max_parallel`` requests at once (per server:
``cloud_max_parallel`` for the cloud route's), whatever the model; the waiting ones are
served in weighted fair order between tenants and trees
(:class:`runtime.llm.fair_slots.FairSlots`), after their tenant's token bucket gave them
their tokens (:class:`runtime.llm.token_meter.TokenMeter`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.config import Settings
from runtime.llm.fair_slots import Ticket
from runtime.llm.loop import CallLoop
from runtime.llm.reply import Backend
from runtime.llm.request import CallProgress
from runtime.llm.token_meter import StopCheck


@dataclass(frozen=True)
class Fair:
    """Whose a request is, for the fair order: its tenant, its tree, its priority."""

    tenant: str
    tree: Any
    priority: int


class ServerSlots:
    """Hands each request its ticket for its server's slots.

    Args:
        calls: the loops calls run on (one set of slots per loop and server).
        backend: names each route's server (``host_for``; else the backend's name) and,
            with ``parallel_for``, a limit of its own (the tighter one counts).
        settings: ``[ollama]`` (the per-server limits) and ``[tenants]`` (weights).

    """

    def __init__(self, calls: CallLoop, backend: Backend, settings: Settings) -> None:
        self._calls = calls
        self._backend = backend
        self._settings = settings

    def ticket(self, call: CallProgress, fair: Fair, stopped: StopCheck | None = None) -> Ticket:
        """``request``'s turn at its route's server, its reservation as its estimate."""
        route = call.routed.route.route
        host = self._backend.host_for(route)  # one server per route
        ollama = self._settings.ollama
        limit = ollama.cloud_max_parallel if route == "cloud" else ollama.max_parallel
        own = self._backend.parallel_for(route)  # (the embedded model's max_parallel)
        if own is not None:  # the tighter of the two
            limit = min(limit, own)
        held = call.held
        estimate = held.prompt_tokens + held.completion_tokens if held is not None else 0
        return self._calls.slot(host, limit).ticket(
            fair.tenant, fair.tree, fair.priority, self._settings.tenant_weight(fair.tenant),
            estimate, stopped)
