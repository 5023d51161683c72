"""The audit: a run's history and the database checked against the runtime's promises.

``orgchart audit`` (``runtime/cli/audit.py``) and every fault test run
:func:`runtime.audit.checker.audit`: it reads what the database holds in bounded batches
(read only, :mod:`runtime.audit.facts`), and what clients were told from a history file
(JSON lines, :mod:`runtime.audit.history`), and reports each broken promise as a
:class:`runtime.audit.report.Violation` with the few operations and events that show it.
The promises and their checks are listed in docs/architecture.md ("What we promise, and
how it is checked").
"""
