"""Which route a model call takes: the local model or the cloud model (seed 001).

A prompt longer than ``[routing] prompt_threshold`` characters, or a pending queue deeper
than ``[routing] pending_threshold`` tasks, goes to the cloud model (``[models] cloud``);
everything else goes to the local model (``[models] local``). Both comparisons are
strict: a prompt of exactly ``prompt_threshold`` characters stays local. The decision
carries a short sentence saying why, stored with the task (``route_reason``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runtime.config import Settings

RouteName = Literal["local", "cloud"]


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
