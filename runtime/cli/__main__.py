"""``python -m runtime.cli``: the ``orgchart`` command."""

from runtime.cli import main

main()
