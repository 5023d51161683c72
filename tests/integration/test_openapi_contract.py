"""The HTTP API answers what its OpenAPI document says, checked by schemathesis.

Schemathesis's own engine (what ``schemathesis run`` drives) against the ASGI app on a
test database, bounded (``EXAMPLES`` cases per operation and phase, deterministic):
its examples, coverage (boundary and malformed values, bodies that are not JSON),
fuzzing (data that fits each schema and data that does not) and stateful phases (chains
of calls following the document's links from the task ``POST /tasks`` or a fork answers
to the operations that take its id), with every default check of ``st run``: no server
error, no status, content type, header or body the document does not list, data that
fits the document accepted (2xx, or 404/409 for a task that is missing or in another
state) and data that does not refused, a 405 with an ``Allow`` naming every method of
the path. Any finding fails the test: the document says what the server enforces.

tests/integration/test_api_fuzz.py throws odder bytes and headers at the same app and
checks the error bodies; this test holds the document to the answers.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import warnings
from collections import Counter

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import strategies as st
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events, from_schema

from runtime.config import load_settings
from runtime.http.api import create_app
from runtime.http.constraints import PYTHON_REGEX
from runtime.http.document import TASK_CREATORS, TASK_ID_PARAMETERS
from runtime.store.store import Store
from runtime.wiring import build_runtime


def _import_all_of_schemathesis() -> None:
    """Import schemathesis's modules now, at collection, in the main thread, alone.

    It imports most of them lazily, during a run, through pytest's assertion rewriting
    (schemathesis is a pytest plugin), which parses each with ``ast``. CPython 3.11's
    parser is not safe against two threads parsing at once, and a thread left by an
    earlier test (a worker's agents) may be parsing: the import then failed with
    ``SystemError: AST constructor recursion depth mismatch`` (seen once in a full run).
    """
    for module in pkgutil.walk_packages(schemathesis.__path__, "schemathesis."):
        with contextlib.suppress(Exception):  # an optional extra that is not installed
            importlib.import_module(module.name)


_import_all_of_schemathesis()

# A ``matches`` check's value is a regular expression as Python reads it (the document's
# ``python-regex`` format): schemathesis is told how to write one.
_PIECES = st.sampled_from(["a", "b", "[a-z]", r"\d", r"\w", ".", "(x|y)", r"\]", "é"])
schemathesis.openapi.format(PYTHON_REGEX, st.lists(
    st.tuples(_PIECES, st.sampled_from(["", "*", "+", "?", "{1,3}"])).map("".join),
    max_size=4).map("".join))

#: Cases per operation in each generating phase: about 2,600 requests in all (most from
#: the coverage phase, which the limit does not bound), 40 s of CPU.
EXAMPLES = 15
CONFIG = {  # every check on, as ``st run``'s defaults
    "generation": {"max-examples": EXAMPLES, "deterministic": True},
    # A tree's stream (``GET /trees/{id}/stream``, Server-Sent Events) stays open while
    # the tree runs: its status, headers and first event are checked, then it is cut
    # (else each one the stateful phase opens on a new task waits out the read timeout).
    "max-stream-events": 1,
    # The stateful phase follows the document's links only (schemathesis would also guess
    # links from Location headers and names), with data that fits, so tasks get made.
    "phases": {"stateful": {"max-steps": 8, "inference": {"algorithms": []},
                            "generation": {"mode": "positive"}}},
}


#: Headers every request carries: left out of a failure's message.
_COMMON_HEADERS = {"user-agent", "accept", "accept-encoding", "connection", "content-length",
                   "x-schemathesis-testcaseid", "content-type"}


@pytest.fixture
def app(db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch) -> FastAPI:
    monkeypatch.delenv("ORGCHART_API_TOKEN", raising=False)
    # A webhook's host must resolve to a public address unless allow_private: DNS is the
    # machine's, not the document's, so the run lets any well-formed URL through. Its
    # test sends fail fast (no retries behind which the next test send would wait).
    cfg = load_settings(env={"ORGCHART_DATABASE_URL": db_url,
                             "ORGCHART_LLM__BACKEND": "offline",
                             "ORGCHART_WEBHOOKS__ALLOW_PRIVATE": "true",
                             "ORGCHART_WEBHOOKS__TIMEOUT_SECONDS": "1",
                             "ORGCHART_WEBHOOKS__MAX_ATTEMPTS": "1"})
    runtime = build_runtime(cfg, ["tests.support_agents"], store=store)
    return create_app(store=store, settings=cfg, registry=runtime.registry)


def run_schemathesis(app: FastAPI) -> tuple[list[str], Counter[tuple[str, str, int]]]:
    """One bounded run; the failures found, and the answers by (phase, operation, status)."""
    with warnings.catch_warnings():  # starlette's notice about httpx2
        warnings.filterwarnings("ignore", message=".*httpx2")
        schema = schemathesis.openapi.from_asgi("/openapi.json", app,
                                                config=SchemathesisConfig.from_dict(CONFIG))
    failures: list[str] = []
    answers: Counter[tuple[str, str, int]] = Counter()
    for event in from_schema(schema).execute():
        if isinstance(event, events.FatalError | events.NonFatalError):
            failures.append(f"schemathesis error: {event}")
        if not isinstance(event, events.ScenarioFinished):
            continue
        for case_id, interaction in event.recorder.interactions.items():
            if interaction.response is not None:
                label = event.recorder.cases[case_id].value.operation.label
                answers[(event.phase.value, label, interaction.response.status_code)] += 1
        for case_id, checks in event.recorder.checks.items():
            label = event.recorder.cases[case_id].value.operation.label
            interaction = event.recorder.interactions.get(case_id)
            failures += [f"{label}: {check.name}: {check.failure_info.failure.title} "
                         f"({' '.join(check.failure_info.failure.message.split())[:200]})"
                         f"{_exchange(interaction)}"
                         for check in checks if check.failure_info is not None]
    return failures, answers


def _exchange(interaction: object) -> str:
    """The request sent and the answer got, shortened, for a failure's message."""
    if interaction is None:
        return ""
    request, response = interaction.request, interaction.response  # type: ignore[attr-defined]
    sent = f"\n    sent {request.method} {request.uri} {(request.body or b'')[:900]!r}"
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _COMMON_HEADERS}
    if headers:
        sent += f" headers {headers}"
    if response is None:
        return sent
    return sent + (f"\n    got {response.status_code} {response.headers.get('allow', '')} "
                   f"{response.content[:300]!r}")


def test_every_answer_is_documented_and_none_is_a_server_error(app: FastAPI) -> None:
    failures, answers = run_schemathesis(app)
    assert not failures, "\n".join(sorted(set(failures)))
    assert sum(answers.values()) > 300, answers
    assert {phase for phase, _, _ in answers} >= {"coverage", "fuzzing", "stateful"}
    # The stateful phase got past the 404s of operations that look a task up: it
    # followed the links from a new task to them.
    found = {label for _, label, status in answers if status == 404}
    reached = {label for phase, label, status in answers
               if phase == "stateful" and 200 <= status < 300 and label in found}
    assert len(reached) >= 3, sorted(k for k in answers if k[0] == "stateful")


def test_a_malformed_body_answers_the_documented_422_everywhere(app: FastAPI) -> None:
    from fastapi.testclient import TestClient

    document = app.openapi()
    with TestClient(app) as client:
        for path, item in document["paths"].items():
            for method, operation in item.items():
                if "requestBody" not in operation:
                    continue
                url = path.format_map({p: "00000000-0000-0000-0000-000000000000"
                                       for p in TASK_ID_PARAMETERS})
                for body in (b"{not json", b"\x9b\xff"):  # not JSON; not UTF-8
                    response = client.request(method, url, content=body,
                                              headers={"content-type": "application/json"})
                    assert response.status_code == 422, (method, path, body, response.text)
                    assert "422" in operation["responses"]
                    assert "not valid JSON" in response.json()["error"]


def test_a_new_task_links_to_every_operation_that_takes_its_id(app: FastAPI) -> None:
    document = app.openapi()
    takes_an_id = set()
    for item in document["paths"].values():
        for operation in item.values():
            names = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            if names and names <= TASK_ID_PARAMETERS:
                takes_an_id.add(operation["operationId"])
    assert len(takes_an_id) >= 15
    for method, path in TASK_CREATORS:
        links = document["paths"][path][method]["responses"]["201"]["links"]
        assert set(links) == takes_an_id, (path, takes_an_id ^ set(links))
        for link in links.values():
            assert set(link["parameters"].values()) == {"$response.body#/id"}
