"""Which route a model call takes: the local model or the cloud model (seed 001).

A prompt longer than ``[routing] prompt_threshold`` characters, or a pending queue deeper
than ``[routing] pending_threshold`` tasks, goes to the cloud model (``[models] cloud``);
everything else goes to the local model (``[models] local``). Both comparisons are
strict: a prompt of exactly ``prompt_threshold`` characters stays local. The decision
carries a short sentence saying why, stored with the task (``route_reason``).

:class:`Router` is the route stage of one model call: it decides the route (a fork may
have set the model), prices it (``[cost]``) and names the request's record key. A
backend that runs one model of its own whatever the route (the embedded model: its
``served_model``) records and prices every call under that model and its own price.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal

from runtime.config import Settings
from runtime.errors import UnknownPrice
from runtime.llm.reply import NOT_RECORDED, request_key, request_text
from runtime.llm.tool_loop import round_note

if TYPE_CHECKING:
    from runtime.llm.request import Request

RouteName = Literal["local", "cloud"]
#: How long one read of the pending queue's depth serves routing decisions.
DEPTH_TTL_SECONDS = 0.5


@dataclass(frozen=True)
class Route:
    """One routing decision.

    Attributes:
        route: ``"local"`` or ``"cloud"``.
        model: the model name configured for that route.
        reason: a short sentence naming the signal that decided it.

    """

    route: RouteName
    model: str
    reason: str


@dataclass(frozen=True)
class Routed:
    """What the route stage decided for a call, once (:class:`Router`): frozen.

    Attributes:
        route: the route, its model and why (``model_calls.route``, ``route_reason``).
        price: the model's price per token (zero for a reply served from the record).
        request_hash: the record key: the request's hash for the routed model.
        stored_prompt: the prompt as the call's rows store it.

    """

    route: Route
    price: Decimal
    request_hash: str
    stored_prompt: str


def decide_route(prompt: str, pending_depth: int, settings: Settings) -> Route:
    """Choose the route for one model call.

    Args:
        prompt: the prompt text; its length in characters is compared with
            ``routing.prompt_threshold``.
        pending_depth: how many tasks are pending right now; compared with
            ``routing.pending_threshold``.
        settings: the configuration (``[routing]`` and ``[models]``).

    Returns:
        The route, its model and the reason.

    Raises:
        TypeError: ``prompt`` is not a string.
        ValueError: ``pending_depth`` is negative.

    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, not {type(prompt).__name__}")
    if pending_depth < 0:
        raise ValueError(f"pending_depth cannot be negative (got {pending_depth})")
    routing = settings.routing
    length = len(prompt)
    long_prompt = length > routing.prompt_threshold
    deep_queue = pending_depth > routing.pending_threshold
    if long_prompt or deep_queue:
        reasons = []
        if long_prompt:
            reasons.append(f"prompt {length} chars > prompt_threshold {routing.prompt_threshold}")
        if deep_queue:
            reasons.append(
                f"pending queue {pending_depth} > pending_threshold {routing.pending_threshold}"
            )
        return Route("cloud", settings.models.cloud, "; ".join(reasons))
    return Route(
        "local",
        settings.models.local,
        f"prompt {length} chars <= prompt_threshold {routing.prompt_threshold} and "
        f"pending queue {pending_depth} <= pending_threshold {routing.pending_threshold}",
    )


def price_of(settings: Settings, route: Route) -> Decimal:
    """The routed model's price per token; ``UnknownPrice`` when it has none."""
    price = settings.cost.price_for(route.route, route.model)
    if price is None:
        raise UnknownPrice(
            f"model {route.model!r} (route {route.route}) has no price: set "
            f"cost.{route.route}_per_token, or a price for {route.model!r} in cost.prices, "
            "in orgchart.toml")
    return price


class Router:
    """The route stage: where a request goes, at what price, under which record key.

    The pending queue's depth (a routing signal) is read at most once per
    :data:`DEPTH_TTL_SECONDS` and event loop, the callers of a loop sharing the read in
    flight.

    Args:
        settings: the configuration (``[routing]``, ``[models]``, ``[cost]``, ``[llm]``).
        read_depth: reads the pending queue's depth (the ledger's, off the loop).
        backend: the backend the calls go to; one with a ``served_model`` (its model's
            name and price per token) runs that model on every route.

    """

    def __init__(self, settings: Settings, read_depth: Callable[[], Awaitable[int]],
                 backend: Any = None) -> None:
        self._settings = settings
        self._served: tuple[str, Decimal] | None = backend.served_model
        self._read_depth = read_depth
        self._depth: tuple[float, int] | None = None
        self._depth_reads: dict[asyncio.AbstractEventLoop, asyncio.Future[int]] = {}

    @property
    def served_model(self) -> str | None:
        """The model the backend runs on every route (the embedded model's file), if any."""
        return self._served[0] if self._served else None

    async def pending_depth(self) -> int:
        """The pending queue's depth for routing: one read per TTL and loop, shared."""
        cached = self._depth
        if cached is not None and time.monotonic() - cached[0] < DEPTH_TTL_SECONDS:
            return cached[1]
        loop = asyncio.get_running_loop()
        reading = self._depth_reads.get(loop)
        if reading is None:  # one read in flight per loop; the other callers share it
            reading = asyncio.ensure_future(self._read_depth())
            self._depth_reads[loop] = reading
            reading.add_done_callback(lambda _: self._depth_reads.pop(loop, None))
        depth = await asyncio.shield(reading)
        self._depth = (time.monotonic(), depth)
        return depth

    async def route(self, request: Request, model_override: str | None) -> Routed:
        """``request``'s route, price, record key and stored prompt.

        Raises:
            UnknownPrice: the routed model has no price (a policy violation).

        """
        route = decide_route(request.prompt, await self.pending_depth(), self._settings)
        if model_override:
            route = Route(route.route, model_override,
                          f"{route.reason}; model {model_override} set by a fork")
        if self._served is not None:  # the model that really runs, at its own price
            model, price = self._served
            route = Route(route.route, model, f"{route.reason}; served by {model}")
        else:
            price = price_of(self._settings, route)
        prompt, system, schema = request.prompt, request.system, request.json_schema
        stored = (request_text(prompt, system, schema) if self._settings.llm.record
                  else f"{NOT_RECORDED} request {request_key(prompt, system, schema)}")
        return Routed(route, price, request.key_for(route.model),
                      stored + round_note(request.round))
