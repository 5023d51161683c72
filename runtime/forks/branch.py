"""Fork a tree: a branch re-runs the original from its root, with overrides at one task.

``orgchart fork TASK_ID`` and ``POST /tasks/{id}/fork`` come here. :func:`fork` checks
the overrides against the registry and the configuration (nothing is written when one is
wrong), then inserts the branch's root (:meth:`runtime.store.tasks.Tasks.fork_root`).

How a branch runs (docs/writing-agents.md, "Tuning a tree"):

- its tasks are linked to their *counterparts*, the tasks at the same path of child keys
  in the original (``forked_from``), by the statement that delegates them;
- the task the fork named gets its overrides: its payload, its agent, and the model of
  its calls and its subtree's;
- every model call that asks exactly what its counterpart asked at the same position is
  served from the counterpart's record, charged zero and marked ``replayed``.

The original tree is only read, never written.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

from agents.registry import InvalidInput, Registry
from runtime.config import Settings
from runtime.errors import BadInput
from runtime.store.queries import Task
from runtime.store.rows import NewBranch
from runtime.store.store import Store
from runtime.wiring import check_storable


def known_models(settings: Settings) -> dict[str, Decimal]:
    """Every model a fork may name, with its per-token price (a model with no price is out)."""
    cost, models = settings.cost, settings.models
    priced: dict[str, Decimal] = {}
    for route, model in (("local", models.local), ("cloud", models.cloud)):
        price = cost.price_for(route, model)
        if price is not None:
            priced[model] = price
    priced.update(cost.prices)
    return priced


def _check_model(settings: Settings, model: str) -> None:
    priced = known_models(settings)
    if model not in priced:
        raise BadInput(f"unknown model {model!r} for --model: name one with a price "
                       f"({', '.join(sorted(priced)) or 'none configured'}; "
                       "[models] local/cloud or [cost] prices)")


def plan_fork(store: Store, registry: Registry, settings: Settings, task_id: uuid.UUID, *,
              payload: dict[str, Any] | None = None, agent: str | None = None,
              model: str | None = None, note: str | None = None,
              budget_tokens: int | None = None,
              budget_usd: Decimal | None = None) -> NewBranch:
    """Check a fork's overrides and build its root (nothing is written).

    Raises:
        NotFound: no task ``task_id``.
        UnknownAgent: ``agent`` is not registered.
        BadInput: the payload does not fit the agent's schema, the model is unknown or
            has no price, a budget is negative, or a value cannot be stored.

    """
    target = store.reads.get(task_id)
    original = target if target["parent_id"] is None else store.reads.get(target["root_id"])
    for value, where in ((payload, "payload"), (agent, "agent"), (model, "model"),
                         (note, "note")):
        check_storable(value, where)
    if payload is not None and not isinstance(payload, dict):
        raise BadInput(f"payload must be a JSON object, not {type(payload).__name__}")
    name = agent or str(target["to_agent"])
    cls = registry.get(name)
    if payload is not None or agent is not None:
        try:
            registry.validate_input(name, target["payload"] if payload is None else payload)
        except InvalidInput as exc:
            raise BadInput(f"the payload does not fit agent {name!r}: {exc}") from None
    if model is not None:
        _check_model(settings, model)
    for what, budget in (("budget_tokens", budget_tokens), ("budget_usd", budget_usd)):
        if budget is not None and budget < 0:
            raise BadInput(f"{what} must not be negative (got {budget})")
    spec: dict[str, Any] = {"target": str(target["id"])}
    if payload is not None:
        spec["payload"] = payload
    if agent is not None:
        spec["agent"] = agent
        spec["type"] = (target["type"] if target["type"] in cls.types else cls.types[0])
    if model is not None:
        spec["model"] = model
    if note:
        spec["note"] = note
    at_root = target["id"] == original["id"]
    return NewBranch(
        original=original,
        to_agent=str(spec.get("agent", original["to_agent"]) if at_root
                     else original["to_agent"]),
        type=str(spec.get("type", original["type"]) if at_root else original["type"]),
        payload=spec.get("payload", original["payload"]) if at_root else original["payload"],
        fork=spec, model_override=model if at_root else None,
        budget_tokens=budget_tokens, budget_usd=budget_usd)


def fork(store: Store, registry: Registry, settings: Settings, task_id: uuid.UUID,
         actor: str = "fork", **overrides: Any) -> Task:
    """Check the overrides (:func:`plan_fork`), then insert the branch's root; return it."""
    branch = plan_fork(store, registry, settings, task_id, **overrides)
    return store.tasks.fork_root(branch, actor=actor)
