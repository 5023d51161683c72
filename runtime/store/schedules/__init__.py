"""Schedules' rows: stored schedules, and the slots each tick records (migration 0014).

A part of the store (``store.schedules``, :class:`Schedules`). A tick
handles one due schedule in one transaction (:meth:`Schedules.tick`): the
schedule's row is locked (``SKIP LOCKED``: another process handling it is left to it),
and each slot's ``schedule_runs`` row, unique on ``(schedule_id, slot_at)``, is inserted
with the root (or the ``fires`` row) it starts. What to fire when (the cadence, the
catch-up window, the overlap policy) is ``runtime/schedules/``'s; this part only writes.
"""

from runtime.store.schedules.commands import ScheduleExists, Schedules, SlotWriter

__all__ = ["ScheduleExists", "Schedules", "SlotWriter"]
