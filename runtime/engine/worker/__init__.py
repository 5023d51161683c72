"""``orgchart worker``: claims tasks, runs agents and the judge, writes the outcomes.

One event loop per worker process, in pieces, one module each:

- :mod:`~runtime.engine.worker.scheduler`: the claim loop, one coroutine per task in
  flight, the writer of outcomes (batched), maintenance;
- :mod:`~runtime.engine.worker.leases`: the heartbeat; extends every lease held in one
  statement and reports the tasks taken away (:meth:`LeaseKeeper.on_lost`);
- :mod:`~runtime.engine.worker.listener`: wakes the claim loop on LISTEN/NOTIFY (the
  store's task channel), behind the :class:`Notifier` seam;
- :mod:`~runtime.engine.worker.agent_threads`: sync agents and the judge in threads;
- :mod:`~runtime.engine.worker.db_steps`: the blocking steps (claim a batch, write actions,
  maintenance) both the loop and the step API run;
- :mod:`~runtime.engine.worker.state`: what is held and how the pieces signal;
- :mod:`~runtime.engine.worker.driver`: the :class:`Worker` that puts them together
  (``run()`` on a loop, ``run_once()`` by hand);
- :mod:`~runtime.engine.worker.settings`: its options, what it did, its constants.

Options (:class:`WorkerConfig`): agents, max in flight, sync threads, batch size, lease,
task cap, wall clock, ``once`` (exit when the queue is empty). It stops on ``stop()``
(SIGTERM/SIGINT in the CLI): no more claims, in-flight work gets ``stop_grace_seconds`` to
finish and be written, whatever is left is released back to the queue (at once with
``stop(now=True)``: a second signal).
"""

from runtime.engine.worker.driver import Worker
from runtime.engine.worker.leases import LeaseKeeper
from runtime.engine.worker.listener import Listener, Notifier
from runtime.engine.worker.settings import JUDGE, WorkerConfig, WorkerStats, new_worker_id
from runtime.engine.worker.state import InFlight

__all__ = ["JUDGE", "InFlight", "LeaseKeeper", "Listener", "Notifier", "Worker",
           "WorkerConfig", "WorkerStats", "new_worker_id"]
