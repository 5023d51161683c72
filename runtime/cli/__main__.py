"""``python -m runtime.cli``: the ``orgchart`` command."""

from runtime.cli.app import main

main()
