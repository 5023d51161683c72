"""The MCP server face: ``orgchart mcp`` (stdio) and ``/mcp`` on ``orgchart serve``.

- :mod:`runtime.mcp.tools`: the tools, each a thin call into the code the CLI and the
  HTTP API run, with input schemas from the API's request models;
- :mod:`runtime.mcp.resources`: ``orgchart://trees/{root_id}`` and
  ``orgchart://tasks/{id}``, and the watcher that tells subscribers when they change;
- :mod:`runtime.mcp.server`: the SDK's low-level server wired to both, run over stdio
  or mounted on the HTTP API (docs/mcp.md).
"""
