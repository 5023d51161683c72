"""A small MCP server of our own for the tests: notes looked up by topic, over stdio.

Run as ``python tests/mcp_notes_server.py``; it speaks MCP through the official SDK's
server side (``mcp.server.mcpserver.MCPServer``). ``MCP_NOTES_LOG`` names a file to which
every ``lookup_note`` call appends one line (so a test can count side effects);
``MCP_NOTES_PIDS`` names a file to which the server appends its process id when it starts
(so a test can kill it and count its restarts); while the file ``MCP_NOTES_NO_START``
names exists, the server exits at once (a server that keeps dying).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and os.path.exists(os.environ.get("MCP_NOTES_NO_START", "\0")):
    sys.exit(1)  # before the SDK's imports: a server that dies at once

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

NOTES = {
    "durable": "Durable execution records each step so a crash does not repeat it.",
    "postgres": "PostgreSQL's SKIP LOCKED lets many workers claim rows without waiting.",
}

server = MCPServer("notes")


@server.tool()
def lookup_note(topic: str) -> str:
    """Return the note kept about a topic (empty when there is none)."""
    log = os.environ.get("MCP_NOTES_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as out:
            out.write(topic + "\n")
    for key, note in NOTES.items():
        if key in topic.lower():
            return note
    return ""


@server.tool()
def count_words(text: str, minimum: int = 0) -> int:
    """Count the words of a text that are at least ``minimum`` letters long."""
    return sum(1 for word in text.split() if len(word) >= minimum)


@server.tool()
def refuse(reason: str) -> str:
    """Always fails, with the reason given (an anticipated error: the client reads it)."""
    raise ToolError(reason)


if __name__ == "__main__":
    pids = os.environ.get("MCP_NOTES_PIDS")
    if pids:
        with open(pids, "a", encoding="utf-8") as out:
            out.write(f"{os.getpid()}\n")
    server.run("stdio")
