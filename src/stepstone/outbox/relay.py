"""The relay service: leases staged events, publishes them, records what the broker acknowledged.

    claim     one statement: up to `batch_size` pending events in staged order, below the visibility
              horizon, SKIP LOCKED, minus any whose key has an older unpublished event not taken with
              it (outbox.sql); leased to this relay for `lease_seconds` on the db clock
    publish   the batch in claim order through the publisher, bounded by half the lease so a
              publish never outlives its lease (which would let another relay overtake it)
    settle    one statement fenced on the lease token: per key, the acknowledged prefix is marked
              published; the first event of a key that failed is retried with backoff or, refused or
              failed `max_attempts` times, dead-lettered; the key's later events are released
    wait      for a notification of a staged event, or the poll interval

A crash anywhere leaves the batch leased and unpublished in the database; the lease expires and any
relay publishes it again: at least once. Tests wait on `RelayEvents`, never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from stepstone._waiting import wait_set
from stepstone.core.bounds import MAX_BATCH, check_count, check_seconds
from stepstone.core.limits import MAX_INT4
from stepstone.errors import BrokerMisconfigured, BrokerUnavailable
from stepstone.observability.publishing import publish_spans
from stepstone.outbox.publisher import Outcome, Publisher, PublishResult, publish_progress
from stepstone.runtime.counters import Counters
from stepstone.store.outbox import OutboxStore, Settlement, StagedEvent
from stepstone.store.postgres import Listener

__all__ = ["Relay", "RelayConfig", "RelayEvents", "settlements"]

log = logging.getLogger("stepstone.relay")


def default_relay_id() -> str:
    return f"relay:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class RelayConfig:
    batch_size: int = 500
    max_attempts: int = 10
    lease_seconds: float = 30.0
    poll_interval: float = 1.0
    retry_base: float = 1.0
    """Backoff of an event's n-th failed attempt: retry_base * 2**(n-1), capped at retry_max."""
    retry_max: float = 300.0
    relay_id: str = field(default_factory=default_relay_id)

    def __post_init__(self) -> None:
        check_count("RelayConfig", "batch_size", self.batch_size, 1, MAX_BATCH)
        check_count("RelayConfig", "max_attempts", self.max_attempts, 1, MAX_INT4)
        for what in ("lease_seconds", "poll_interval"):
            check_seconds("RelayConfig", what, getattr(self, what))
        for what in ("retry_base", "retry_max"):  # 0: a failed event is retried at once
            check_seconds("RelayConfig", what, getattr(self, what), zero=True)


@dataclass
class RelayEvents(Counters):
    """Counters tests wait on (`wait_until`) instead of sleeping."""

    batches: int = 0
    published: int = 0
    failed: int = 0
    dead: int = 0
    unavailable: int = 0
    misconfigured: int = 0
    idle: int = 0


def settlements(
    batch: Sequence[StagedEvent], results: Sequence[PublishResult], config: RelayConfig
) -> list[Settlement]:
    """What to record for a published batch: per key, the acknowledged prefix is published; the key's
    first failure is retried or dead-lettered; what follows it in the key is released untouched."""
    out: list[Settlement] = []
    stopped: set[str] = set()
    for event, result in zip(batch, results, strict=True):
        if event.key is not None and event.key in stopped:
            out.append(Settlement(event.id, "release"))
            continue
        if result.outcome is Outcome.OK:
            out.append(Settlement(event.id, "published"))
            continue
        if event.key is not None:
            stopped.add(event.key)
        if not result.attempted:
            out.append(Settlement(event.id, "release", result.error))
            continue
        attempts = event.attempts + 1
        if result.outcome is Outcome.REFUSED or attempts >= config.max_attempts:
            why = "refused" if result.outcome is Outcome.REFUSED else f"failed {attempts} times"
            out.append(Settlement(event.id, "dead", f"{why}: {result.error}", counted=True))
            continue
        delay = min(config.retry_max, config.retry_base * 2 ** (attempts - 1))
        out.append(Settlement(event.id, "retry", result.error, delay, counted=True))
    return out


def _cut_short(progress: dict[int, PublishResult | None], event_id: int) -> PublishResult:
    """An event's result when its publish outlived half the lease: the broker's answer if it came, a failed
    attempt if its send had begun, and nothing counted if it was never offered."""
    if event_id not in progress:
        return PublishResult.transient("not sent: the publish timed out (half the lease) first", attempted=False)
    return progress[event_id] or PublishResult.transient("publish timed out (half the lease)")


class Relay:
    """Publishes the outbox through `publisher` until stopped; several may run at once."""

    def __init__(self, outbox: OutboxStore, publisher: Publisher, config: RelayConfig | None = None) -> None:
        self.outbox = outbox
        self.publisher = publisher
        self.config = config or RelayConfig()
        self.events = RelayEvents()
        self._wake = asyncio.Event()  # a staged event was notified, or wake()/stop()
        self._kick = asyncio.Event()  # wake()/stop() only: also cuts a broker backoff short
        self._stopping = False
        self._loop: asyncio.Task[None] | None = None
        self._listener: Listener | None = None
        self._claimed_last = 0
        self._failures = 0  # rounds failed in a row: the loop tells an outage, the wake-up line only its start
        self._refused_setup: BrokerMisconfigured | None = None  # the last publish's, if the broker refused its setup

    async def start(self) -> None:
        await self._open_listener()
        self._loop = asyncio.create_task(self._run(), name=f"stepstone-relay-{self.config.relay_id}")

    async def stop(self) -> None:
        """Finish the batch in hand (claim, publish, settle), then stop."""
        self._stopping = True
        self.wake()
        if self._loop is not None:
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(Exception):
                await listener.close()

    @property
    def last_claimed(self) -> int:
        """How many events the last claim took (0: nothing claimable at that moment)."""
        return self._claimed_last

    def wake(self) -> None:
        """Look for work now (and retry an unreachable broker now)."""
        self._kick.set()
        self._wake.set()

    async def run_once(self) -> int:
        """Claim, publish and settle one batch; returns how many events were published."""
        token = uuid.uuid4()
        batch = await self.outbox.claim(self.config.batch_size, self.config.lease_seconds,
                                        self.config.relay_id, token)
        self._claimed_last = len(batch)
        if not batch:
            self.events.count("idle")
            return 0
        with publish_spans(batch, self.publisher.name) as spans:
            results = await self._publish(batch)
            spans.results(results)
        held = next((r for r in results if r.misconfigured), None)  # also in a publish cut at half the lease
        if held is not None and self._refused_setup is None:  # an answer about the configuration, not the event
            self._refused_setup = BrokerMisconfigured(held.error or f"{self.publisher.name}: misconfigured")
        planned = settlements(batch, results, self.config)
        recorded = await self.outbox.settle(token, planned)
        plan = [s for s in planned if s.id in recorded]  # the rest were fenced: another relay holds them now
        if len(plan) < len(planned):
            log.warning("relay %s: %d event(s) of the batch were taken over by another relay (their lease ran out "
                        "first); what this relay made of them is not recorded", self.config.relay_id,
                        len(planned) - len(plan))
        published = sum(1 for s in plan if s.action == "published")
        self.events.count("published", published)
        self.events.count("failed", sum(1 for s in plan if s.action == "retry"))
        dead = [s for s in plan if s.action == "dead"]
        for s in dead:
            log.warning("outbox event %s dead-lettered (%s); its key waits until `stepstone outbox requeue`",
                        s.id, s.error)
        self.events.count("dead", len(dead))
        if self._refused_setup is not None:  # held, not failed: the broker's configuration is to blame
            self.events.count("misconfigured")
            raise self._refused_setup
        if all(not r.attempted for r in results):
            self.events.count("unavailable")
            raise BrokerUnavailable(next(r.error for r in results if not r.attempted) or "broker unavailable")
        self.events.count("batches")
        return published

    async def run_until_idle(self) -> int:
        """Publish batches until a claim finds nothing (tests, the demo); returns the count published.

        Events backing off, leased elsewhere or above the visibility horizon are left for later."""
        total = 0
        while True:
            idle_before = self.events.idle
            total += await self.run_once()
            if self.events.idle > idle_before:
                return total

    async def _publish(self, batch: list[StagedEvent]) -> list[PublishResult]:
        self._refused_setup = None
        with publish_progress() as progress:
            try:
                async with asyncio.timeout(self.config.lease_seconds / 2):
                    results = await self.publisher.publish(batch)
            except BrokerUnavailable as exc:
                return [PublishResult.transient(str(exc), attempted=False)] * len(batch)
            except BrokerMisconfigured as exc:
                # Every batch would meet it, whatever its events: counting attempts would dead-letter the
                # whole outbox after max_attempts. Released with the error (`outbox list` shows it).
                self._refused_setup = exc
                return [PublishResult.transient(str(exc), attempted=False)] * len(batch)
            except TimeoutError:
                if progress:  # what the broker acknowledged before the cut stays acknowledged
                    acked = sum(1 for r in progress.values() if r is not None and r.outcome is Outcome.OK)
                    log.warning("relay %s: publishing %d event(s) to %s outlived half the lease; %d acknowledged "
                                "by then are kept, the rest go again", self.config.relay_id, len(batch),
                                self.publisher.name, acked)
                    return [_cut_short(progress, event.id) for event in batch]
                error = "publish timed out (half the lease)"
            except Exception as exc:  # noqa: BLE001 - the publisher's own failure (its configuration, a bug)
                error = f"{type(exc).__name__}: {exc}"
            else:
                if len(results) != len(batch):
                    raise RuntimeError(f"{self.publisher.name} answered {len(results)} results for "
                                       f"{len(batch)} events")
                return results
        # Not the broker's "unreachable": counted against each event (backoff, then a dead letter), so a
        # batch is settled and reported instead of left leased and claimed again for ever.
        log.warning("relay %s: publishing %d event(s) to %s failed: %s; counted as a failed attempt",
                    self.config.relay_id, len(batch), self.publisher.name, error)
        return [PublishResult.transient(error)] * len(batch)

    async def _run(self) -> None:
        unreachable = False  # the last failure was the broker's BrokerUnavailable
        quick = False
        while not self._stopping:
            self._wake.clear()
            try:
                if self._listener is None or not self._listener.alive:
                    await self._open_listener()
                await self.run_once()
                if self._failures:
                    log.info("relay %s: %s", self.config.relay_id,
                             f"{self.publisher.name} answers again" if unreachable
                             else f"working again after {self._failures} failure(s)")
                self._failures = 0
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any single failure
                self._failures += 1
                unreachable = isinstance(exc, BrokerUnavailable)
                refused = isinstance(exc, BrokerMisconfigured)  # until someone fixes it: look less often
                delay = min(30.0 if refused else 5.0, 0.05 * 2**self._failures) * random.uniform(0.5, 1.0)  # noqa: S311
                if refused and (self._failures == 1 or self._failures % 20 == 0):
                    log.error("relay %s: the broker refuses the publisher's setup: %s. Fix the broker or the "  # noqa: TRY400 - one line, no traceback
                              "broker URL; events are held, no attempt counted, trying again in %.0f s",
                              self.config.relay_id, exc, delay)
                elif self._failures == 1 or self._failures % 20 == 0:
                    log.warning("relay %s: %s: %s; events wait, retrying in %.2f s", self.config.relay_id,
                                type(exc).__name__, exc, delay)
                if not self._stopping:
                    self._kick.clear()
                    await wait_set(self._kick, delay)  # notifications do not: the broker is the problem
                continue
            if self._claimed_last:
                quick = False
                continue
            # Nothing claimable. A notification may have named an event whose transaction is not yet
            # below the horizon: look again soon once, then wait for the next one or the poll interval.
            timeout = min(self.config.poll_interval, 0.02) if quick else self.config.poll_interval
            quick = await wait_set(self._wake, timeout)

    async def _open_listener(self) -> None:
        try:
            self._listener = await self.outbox.listen(self._wake.set)
        except Exception as exc:  # noqa: BLE001 - polling covers its absence
            self._listener = None
            log.log(logging.DEBUG if self._failures else logging.WARNING,  # the loop tells an outage
                    "relay wake-up connection unavailable (%s); polling every %g s",
                    type(exc).__name__, self.config.poll_interval)
