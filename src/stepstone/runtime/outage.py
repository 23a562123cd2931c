"""What a worker says while its database fails the claim loop: the claim loop speaks for the outage.

Its first failure is a warning, said once an outage: the retries that fail the same way are logged at
DEBUG (with the attempts so far and the delay before the next), and one that fails another way (another
exception class) warns again. The first claim that works again after failures says so at INFO, with
how many attempts failed over how long. The
worker's other loops (the wake-up connection, the schedule firer, the heartbeat) meet the same outage:
they log a `DatabaseUnavailable` at DEBUG, so an outage is one story in the log, not four interleaved.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from stepstone.errors import DatabaseUnavailable

__all__ = ["ClaimOutage", "until_reachable"]

_T = TypeVar("_T")

log = logging.getLogger("stepstone.worker")


class ClaimOutage:
    """The claim loop's run of failures: the delay before each retry and the lines that tell the outage."""

    def __init__(self) -> None:
        self.failures = 0
        """Failed claims since the last one that worked."""
        self._since = 0.0
        self._told: str | None = None  # the exception class the last warning named

    def failed(self, exc: Exception, now: float) -> float:
        """Log a failed claim (a warning when the outage starts or fails another way, else DEBUG); returns
        how long to wait before the next (backoff with jitter, at most 5 s)."""
        if not self.failures:
            self._since = now
        self.failures += 1
        delay = min(5.0, 0.1 * 2.0**self.failures) * random.uniform(0.5, 1.0)  # noqa: S311 - jitter
        kind = type(exc).__name__
        if kind != self._told:
            self._told = kind
            log.warning("claim failed (%s: %s); retrying in %.2f s, then backing off to every 5 s (said once while "
                        "it fails this way: quiet until claims work again)", kind, exc, delay)
        else:
            log.debug("claim failed again (%s: %s), %d attempt(s) over %.1f s; retrying in %.2f s", kind, exc,
                      self.failures, now - self._since, delay)
        return delay

    def worked(self, now: float) -> None:
        """A claim worked; after failures, say so once."""
        if self.failures:
            log.info("claims work again after %d failed attempt(s) over %.1f s", self.failures, now - self._since)
            self.failures = 0
            self._told = None


async def until_reachable(ask: Callable[[], Awaitable[_T]]) -> _T:
    """`ask()`, asked again with backoff (0.05 s doubling to 2 s) while the database is unreachable: for the
    reads a segment makes after its handler ran (a child's version, an unknown commit's outcome), where a
    segment that crashed would run the step again after its lease. A lease lost meanwhile fences the
    commit, as any other."""
    delay = 0.05
    while True:
        try:
            return await ask()
        except DatabaseUnavailable:
            await asyncio.sleep(delay)  # backoff while the connection is re-established
            delay = min(delay * 2, 2.0)
