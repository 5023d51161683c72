"""What every runtime's tree shares: the work's sizes, its prompts and its model client.

The prompts are the same strings in every runtime (a writer: ``write lead {i} part {j}``;
the planner's aggregate: ``sum up {n} leads``; a chain's level: ``link {level}``), sent as
one user message with at most 8 tokens to answer, so the model server sees the same calls.

Two clients, as the issue asks:

- ``ollama``: the official ``ollama.AsyncClient`` at its default settings, as a user of
  the runtime would write it (httpx's default pool: at most 100 connections);
- ``shared``: the same official client over orgchart's own HTTP/1.1 transport
  (:class:`runtime.llm.backends.transport.LeanAsyncClient`) with the call limit of
  ``bench.makespan`` (2,000), injected into every runtime, so that engines are compared
  and not HTTP clients. orgchart's worker always sends this way.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ollama

from runtime.llm.backends.transport import LeanAsyncClient

#: A model call: a prompt in, the answer's text out.
Chat = Callable[[str], Awaitable[str]]
#: The model name sent (the loopback server answers any).
MODEL = "llama3.2"
#: Calls in flight at once through the shared client (``bench.makespan``'s max_parallel).
CALL_LIMIT = 2000


@dataclass(frozen=True)
class Shape:
    """The work: a tree (1 -> ``leads`` -> ``writers``) or a chain ``depth`` levels deep."""

    kind: str = "tree"
    leads: int = 30
    writers: int = 30
    depth: int = 50

    @property
    def calls(self) -> int:
        """Model calls the work makes: every writer and the planner; or every level."""
        return self.leads * self.writers + 1 if self.kind == "tree" else self.depth


def writer_prompt(lead: int, part: int) -> str:
    """A writer's prompt."""
    return f"write lead {lead} part {part}"


def planner_prompt(leads: int) -> str:
    """The planner's aggregate prompt."""
    return f"sum up {leads} leads"


def link_prompt(level: int) -> str:
    """A chain level's prompt."""
    return f"link {level}"


class SharedClient(ollama.AsyncClient):
    """The official async client over orgchart's transport (as ``runtime.llm.backends.ollama``)."""

    def __init__(self, host: str, **kwargs: Any) -> None:
        # ollama.AsyncClient.__init__ passes httpx.AsyncClient; its base takes the class.
        super(ollama.AsyncClient, self).__init__(LeanAsyncClient, host, **kwargs)


def chat_client(model_url: str, client: str) -> Chat:
    """A :data:`Chat` through ``client`` (``ollama`` or ``shared``)."""
    official = (ollama.AsyncClient(host=model_url) if client == "ollama" else
                SharedClient(host=model_url, timeout=120.0, max_connections=CALL_LIMIT))

    async def chat(prompt: str) -> str:
        reply = await official.chat(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                    options={"num_predict": 8})
        return reply.message.content or ""

    return chat


def code_lines(path: Path) -> int:
    """Lines of code in ``path``: not blank, not only a comment, not a docstring."""
    source = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)
