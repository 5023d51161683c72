"""The OpenAPI document: what FastAPI generates, made to say everything the API answers.

FastAPI documents each route's own ``responses``; the answers that come from elsewhere
are added here, once, by one convention for every operation (so a route added later is
documented the same way):

- 401 on every operation when a bearer token is set (and the ``bearer`` scheme);
- 413 on every operation that takes a body (the guard refuses a larger one unread);
- 422 on every operation that takes a body or parameters: a malformed body (not JSON,
  not UTF-8, the wrong shape), id or query value;
- 503 on every operation: the database does not answer;
- every error's body is the ``Error`` schema, ``{"error": "<message>"}``.

And links: the task that ``POST /tasks`` or ``POST /tasks/{task_id}/fork`` answers
(201, or 200 for a repeated idempotency key) is linked, by its ``id``, to every
operation that takes a task id in its path (``task_id``, ``root_id``, ``root_a``,
``root_b``), so a client (or a test generator) can follow from a new task to what can
be done with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.http.constraints import (
    STORABLE_JSON,
    STORABLE_JSON_REF,
    STORABLE_JSON_SCHEMA,
    STORABLE_TEXT,
)

#: Path parameters that name a task (a root is a task).
TASK_ID_PARAMETERS = frozenset({"task_id", "root_id", "root_a", "root_b"})
#: The operations whose answer is a task to follow: (method, path).
TASK_CREATORS = (("post", "/tasks"), ("post", "/tasks/{task_id}/fork"))
_METHODS = ("get", "put", "post", "delete", "patch")
_REF_TEMPLATE = "#/components/schemas/{model}"
#: Keywords whose value is one schema.
_SUBSCHEMA = frozenset({"items", "additionalProperties", "not", "contains", "if", "then",
                        "else", "propertyNames"})
#: Keywords that say what a value may be (a schema with none of them takes anything).
_TYPED = frozenset({"type", "anyOf", "oneOf", "allOf", "$ref", "enum", "const", "not"})
_ERROR_REF = {"$ref": "#/components/schemas/Error"}
_ERROR_SCHEMA = {
    "title": "Error", "type": "object", "required": ["error"],
    "properties": {"error": {"type": "string", "description": "What went wrong."}},
}
#: The statuses added by convention, with the description used when a route has none.
_CONVENTION = {
    "401": "missing or wrong bearer token",
    "413": "the body is larger than the limit",
    "422": "the request is malformed (the message says where)",
    "503": "the database does not answer",
}


def complete_document(build: Callable[[], dict[str, Any]], token: bool,
                      choices: Choices | None = None) -> Callable[[], dict[str, Any]]:
    """Wrap FastAPI's ``app.openapi`` builder: the result gets the conventions and links.

    Args:
        build: FastAPI's own builder (``app.openapi``), called once.
        token: whether requests need a bearer token (401 and the ``bearer`` scheme).
        choices: the server's agents and models, named where a body takes one.

    Returns:
        A builder to assign to ``app.openapi`` (it caches its document).

    """
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if "document" not in cache:
            cache["document"] = completed(build(), token, choices or Choices())
        return cache["document"]

    return openapi


def completed(document: dict[str, Any], token: bool, choices: Choices) -> dict[str, Any]:
    """``document`` with the conventional statuses, the ``Error`` schema and the links.

    And the values the server takes: every free-form JSON value refers to
    ``StorableJSON``; the agents, their payloads and the models are named.
    """
    document = _swap_marks(document)
    components = document.setdefault("components", {})
    components.setdefault("schemas", {})["Error"] = _ERROR_SCHEMA
    components["schemas"][STORABLE_JSON] = STORABLE_JSON_SCHEMA
    if choices.agents:
        name_choices(document, choices)
    if token:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    operations = list(_operations(document))
    for _method, _path, operation in operations:
        _add_statuses(operation, token)
    links = _task_links(operations)
    for method, path, operation in operations:
        if (method, path) in TASK_CREATORS:
            for status in ("200", "201"):
                if status in operation["responses"]:
                    operation["responses"][status]["links"] = links
    return document


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method, path, item[method]) for path, item in document.get("paths", {}).items()
            for method in _METHODS if method in item]


def _add_statuses(operation: dict[str, Any], token: bool) -> None:
    """Add the conventional statuses to one operation; every error answers ``Error``."""
    responses = operation.setdefault("responses", {})
    wanted = ["503"]
    if token:
        wanted.append("401")
    if "requestBody" in operation:
        wanted.append("413")
    if "requestBody" in operation or operation.get("parameters"):
        wanted.append("422")
    for status in wanted:
        responses.setdefault(status, {"description": _CONVENTION[status]})
    for status, response in responses.items():
        if status[0] in "45":
            # FastAPI's own 422 schema describes its default body, not ours.
            content = response.setdefault("content", {}).setdefault("application/json", {})
            content["schema"] = _ERROR_REF


def _task_links(operations: list[tuple[str, str, dict[str, Any]]]
                ) -> dict[str, dict[str, Any]]:
    """A link to every operation whose path parameters are all task ids."""
    links: dict[str, dict[str, Any]] = {}
    for _method, _path, operation in operations:
        names = [p["name"] for p in operation.get("parameters", []) if p.get("in") == "path"]
        if names and set(names) <= TASK_ID_PARAMETERS and "operationId" in operation:
            links[operation["operationId"]] = {
                "operationId": operation["operationId"],
                "parameters": {name: "$response.body#/id" for name in names},
            }
    return links


# ---------------------------------------------------------------------- what values are
@dataclass(frozen=True)
class Choices:
    """What this server knows that the request models cannot: its agents and models.

    Attributes:
        agents: each agent's name, its task types and its input model's JSON schema
            (refs under ``#/components/schemas/``, with its ``$defs``).
        models: the model names a fork may name (those with a price).
        default_agent: the agent a body without ``agent`` goes to.

    """

    agents: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    default_agent: str = "ceo"


def choices_for(registry: Any, models: Any) -> Choices:
    """The :class:`Choices` of a registry of agents and the priced model names."""
    agents = {}
    for cls in registry:
        schema = cls.input_model.model_json_schema(ref_template=_REF_TEMPLATE)
        agents[cls.name] = (tuple(cls.types), schema)
    return Choices(agents=agents, models=tuple(sorted(models)))


def storable(schema: Any) -> Any:
    """``schema`` where every string, key and free value also refuses a NUL character."""
    if not isinstance(schema, dict):
        return schema
    out = {key: (storable(value) if key in _SUBSCHEMA else value)
           for key, value in schema.items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if key in out:
            out[key] = [storable(item) for item in out[key]]
    for key in ("properties", "$defs", "patternProperties"):
        if key in out:
            out[key] = {name: storable(item) for name, item in out[key].items()}
    types = out.get("type")
    types = [types] if isinstance(types, str) else types or []
    if "string" in types:
        out.setdefault("allOf", []).append({"pattern": STORABLE_TEXT})
    if "object" in types or "properties" in out:
        out.setdefault("propertyNames", {"pattern": STORABLE_TEXT})
        if out.get("additionalProperties", True) is True:
            out["additionalProperties"] = STORABLE_JSON_REF
    if not types and not _TYPED & set(out):  # any value at all
        out.setdefault("allOf", []).append(STORABLE_JSON_REF)
    return out


def _swap_marks(node: Any) -> Any:
    """Replace each :data:`STORABLE_JSON_MARK` left by a request model with the ``$ref``."""
    if isinstance(node, list):
        return [_swap_marks(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _swap_marks(value) for key, value in node.items() if key != "x-orgchart"}
    if node.get("x-orgchart") == STORABLE_JSON:
        out.setdefault("allOf", []).append(STORABLE_JSON_REF)
    return out


def _restrict(prop: dict[str, Any], key: str, values: list[str]) -> None:
    """Put ``{key: values}`` on the string form of a property (it may also be null)."""
    branches = [b for b in prop.get("anyOf", []) if b.get("type") == "string"]
    for branch in branches or [prop]:
        branch[key] = values


def _payload(schema: dict[str, Any], goal_given: bool) -> dict[str, Any]:
    """An agent's input schema as a ``payload`` (its goal may come from the goal field)."""
    payload = storable(dict(schema))
    payload.pop("$defs", None)
    payload.pop("title", None)
    if goal_given and "required" in payload:
        payload["required"] = [name for name in payload["required"] if name != "goal"]
    return payload


def agent_branches(choices: Choices, goal_field: str | None, agent_required: bool = False,
                   typed: bool = False) -> list[dict[str, Any]]:
    """``oneOf`` branches on ``agent``: its task types, its payload, its goal's limits.

    Agents with the same input schema and types share a branch (``agent``: an enum), so
    the document stays small and a generator does not walk the same schema twice.

    Args:
        choices: the agents.
        goal_field: the body's field that becomes ``payload.goal`` (``prompt``, ``goal``),
            or None when the payload is the whole input (a fork's override).
        agent_required: no default agent (a body without ``agent`` matches no branch).
        typed: the body has a ``type`` field (the agent's task types).

    """
    groups: dict[str, list[str]] = {}
    for name, (types, schema) in sorted(choices.agents.items()):
        properties = schema.get("properties", {})
        if goal_field and "goal" not in properties and schema.get("additionalProperties") is False:
            continue  # it takes no goal: it cannot receive one (``human``)
        optional = not agent_required and name == choices.default_agent
        key = json.dumps([types, schema, optional], sort_keys=True)
        groups.setdefault(key, []).append(name)
    branches = []
    for key, names in groups.items():
        types, schema, optional = json.loads(key)
        properties = schema.get("properties", {})
        payload = _payload(schema, goal_given=goal_field is not None)
        agent = {"const": names[0]} if len(names) == 1 else {"enum": names}
        branch: dict[str, Any] = {"properties": {"agent": agent}, "required": []}
        if typed:
            branch["properties"]["type"] = {"anyOf": [{"enum": list(types)}, {"type": "null"}]}
        if goal_field is not None and "goal" in properties:
            goal = storable(properties["goal"])
            branch["properties"][goal_field] = {"anyOf": [goal, {"type": "null"}]}
        if payload.get("required"):
            branch["properties"]["payload"] = payload
            branch["required"].append("payload")
        else:
            branch["properties"]["payload"] = {"anyOf": [payload, {"type": "null"}]}
        if not optional:
            branch["required"].append("agent")
        branches.append(branch)
    return branches


def name_choices(document: dict[str, Any], choices: Choices) -> None:
    """Say which agents and models this server knows, and what each agent's payload is."""
    schemas = document.get("components", {}).get("schemas", {})
    for _types, schema in choices.agents.values():
        for name, definition in schema.get("$defs", {}).items():
            schemas.setdefault(name, storable(definition))
    names = sorted(choices.agents)
    if "SubmitRequest" in schemas:
        _restrict(schemas["SubmitRequest"]["properties"]["agent"], "enum", names)
        schemas["SubmitRequest"].setdefault("allOf", []).append(
            {"oneOf": agent_branches(choices, "prompt", typed=True)})
    if "ScheduleRequest" in schemas:  # the agent and its payload matter with a goal only
        schemas["ScheduleRequest"].setdefault("allOf", []).append({"anyOf": [
            {"properties": {"goal": {"type": "null"}}},
            {"required": ["goal"], "properties": {"goal": {"type": "string"}},
             "oneOf": agent_branches(choices, "goal")}]})
    if "ForkRequest" in schemas:
        fork = schemas["ForkRequest"]
        _restrict(fork["properties"]["agent"], "enum", names)
        _restrict(fork["properties"]["model"], "enum", list(choices.models))
        branches = agent_branches(choices, None, agent_required=True)
        for branch in branches:  # the payload is optional: the task's own is checked
            branch["required"] = ["agent"]
            payload = branch["properties"]["payload"]
            if "anyOf" not in payload:
                branch["properties"]["payload"] = {"anyOf": [payload, {"type": "null"}]}
        none = {"properties": {"agent": {"type": "null"}}}
        fork.setdefault("allOf", []).append({"oneOf": [none, *branches]})
    if "ResolveRequest" in schemas:
        _restrict(schemas["ResolveRequest"]["properties"]["agent"], "enum", names)
