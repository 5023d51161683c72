"""Schedules in the database: recurring root goals, and the orchestrator's fire.

- :mod:`runtime.schedules.slots`: when slots fall (cron lines in a time zone with
  ``croniter`` and ``zoneinfo``, or every N seconds), and which due slots a tick fires
  or counts as missed (the catch-up window).
- :mod:`runtime.schedules.spec`: a schedule to store, validated (``schedule add``).
- :mod:`runtime.schedules.ticker`: the tick every worker, ``serve`` and ``fire``
  process runs beside its work: each due schedule's slots fired exactly once, under the
  overlap policy, in the transaction that records them (``runtime/store/schedules/``).
- :mod:`runtime.schedules.commands`: add, pause, resume, remove, run-now: the CLI's and
  the API's one implementation.
"""
