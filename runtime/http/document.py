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

from collections.abc import Callable
from typing import Any

#: Path parameters that name a task (a root is a task).
TASK_ID_PARAMETERS = frozenset({"task_id", "root_id", "root_a", "root_b"})
#: The operations whose answer is a task to follow: (method, path).
TASK_CREATORS = (("post", "/tasks"), ("post", "/tasks/{task_id}/fork"))
_METHODS = ("get", "put", "post", "delete", "patch")
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


def complete_document(build: Callable[[], dict[str, Any]], token: bool
                      ) -> Callable[[], dict[str, Any]]:
    """Wrap FastAPI's ``app.openapi`` builder: the result gets the conventions and links.

    Args:
        build: FastAPI's own builder (``app.openapi``), called once.
        token: whether requests need a bearer token (401 and the ``bearer`` scheme).

    Returns:
        A builder to assign to ``app.openapi`` (it caches its document).

    """
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if "document" not in cache:
            cache["document"] = completed(build(), token)
        return cache["document"]

    return openapi


def completed(document: dict[str, Any], token: bool) -> dict[str, Any]:
    """``document`` with the conventional statuses, the ``Error`` schema and the links."""
    components = document.setdefault("components", {})
    components.setdefault("schemas", {})["Error"] = _ERROR_SCHEMA
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
