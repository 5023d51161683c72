"""The command line, ``orgchart``: one module per group of commands, one error handler."""
