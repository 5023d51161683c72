"""The retry stage: a request that failed on the way (transient) is sent again.

Backoff with full jitter, a server's ``Retry-After`` honoured (up to
:data:`MAX_RETRY_AFTER_SECONDS`), and a busy server's 503s waited out for up to
``[llm] busy_wait_seconds`` without spending a retry (``[llm] call_retries``).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from runtime.config import LLMSettings
from runtime.core import backoff
from runtime.errors import LeaseLost, TransientModelError
from runtime.llm.request import CallProgress

#: The longest ``Retry-After`` honoured as given (longer ones are cut to this).
MAX_RETRY_AFTER_SECONDS = 300.0


@dataclass
class Retries:
    """One call's retries of transient failures (``[llm]`` settings)."""

    llm: LLMSettings
    spent: int = 0
    busy_waited: float = 0.0

    def delay(self, exc: TransientModelError, requests: int) -> float:
        """Seconds to wait before the next request; raises when the retries are spent."""
        llm = self.llm
        retry_after = getattr(exc, "retry_after", None)  # RetryableModelError's
        if retry_after is not None:
            delay = min(float(retry_after), MAX_RETRY_AFTER_SECONDS)
        else:
            delay = backoff.delay(self.spent, llm.retry_base_seconds, llm.retry_max_seconds,
                                  jitter="full")
        if getattr(exc, "status", None) == 503 and \
                self.busy_waited + delay <= llm.busy_wait_seconds:
            self.busy_waited += delay  # a busy server: wait our turn, keep the retries
        elif self.spent < llm.call_retries:
            self.spent += 1
        else:
            raise TransientModelError(
                f"{exc} (gave up after {requests} request(s) in this call; "
                f"llm.call_retries = {llm.call_retries})") from exc
        return delay

    async def wait(self, exc: TransientModelError, call: CallProgress,
                   lease_lost: threading.Event, task: object) -> None:
        """Wait before sending ``call``'s request again (its kind ``retry``).

        Raises:
            TransientModelError: the server stayed unreachable, busy or slow.
            LeaseLost: the task was taken away while the call waited to retry.

        """
        delay = self.delay(exc, call.rows)  # raises when out of retries
        call.kind = "retry"
        await asyncio.sleep(delay)
        if lease_lost.is_set():
            raise LeaseLost(f"task {task}: lease lost while the model call waited to "
                            "retry") from exc
