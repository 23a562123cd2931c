"""The worker service: claims commands, runs segments, keeps leases, drains on stop.

    claim loop   claims up to the free slots in one statement, spawns a segment per claim,
                 then sleeps until a notification, the earliest future availability or
                 the poll interval, whichever comes first
    segment      apply -> handler (outside any transaction) -> fenced commit, and on
                 through continuations already claimed by the same commit
    lease loop   renews every held lease at TTL/3 in one statement; a lease it can no
                 longer renew marks its segment lost (its commit will be refused)
    waker        one dedicated LISTEN connection; polling covers its absence

Tests wait on `WorkerEvents`, never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from stepstone.authoring.workflow import Registry, Workflow
from stepstone.core.limits import Limits
from stepstone.core.model import CommandView, Decision, RunStep
from stepstone.core.transitions import advance, apply, complete_step
from stepstone.errors import DatabaseUnavailable
from stepstone.runtime.committer import GroupCommitter
from stepstone.runtime.handlers import run_handler
from stepstone.store.port import Claim, CommitRequest, Committed, Pin
from stepstone.store.postgres import Listener, PostgresStore

log = logging.getLogger("stepstone.worker")


_CLAIM_LOOP_EXIT_SECONDS = 10.0


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerConfig:
    concurrency: int = 8
    lease_seconds: float = 30.0
    poll_interval: float = 1.0
    max_claims: int = 5
    drain_timeout: float = 10.0
    # Any role that can connect may NOTIFY the wake-up channel: after a claim that found nothing, claim
    # again at most once per this interval however many notifications arrive.
    min_wake_interval: float = 0.005
    worker_id: str = field(default_factory=default_worker_id)


@dataclass
class WorkerEvents:
    """Counters tests can wait on (`wait_until`), instead of sleeping."""

    claims: int = 0
    commits: int = 0
    fenced: int = 0
    released: int = 0
    deferred: int = 0
    crashed: int = 0
    _waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = field(default_factory=list, repr=False)

    async def bump(self, name: str) -> None:
        setattr(self, name, getattr(self, name) + 1)
        for predicate, future in self._waiters:
            if not future.done() and predicate():
                future.set_result(None)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        if predicate():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = (predicate, future)
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(future, timeout)
        finally:
            self._waiters.remove(waiter)


@dataclass
class _Segment:
    instance_id: str
    token: Any
    lost: bool = False


class Worker:
    """Runs the commands of the workflows in `registry`, `config.concurrency` at a time."""

    def __init__(
        self,
        store: PostgresStore,
        registry: Registry,
        config: WorkerConfig | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.store = store
        self.registry = registry
        self.config = config or WorkerConfig()
        self.limits = limits or Limits()
        self.events = WorkerEvents()
        self._segments: dict[str, _Segment] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._stopping = False
        self._loops: list[asyncio.Task[None]] = []
        self._listener: Listener | None = None
        self._executor = ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="stepstone-step")
        self._committer = GroupCommitter(
            store, lease_seconds=self.config.lease_seconds, worker=self.config.worker_id
        )

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    # -- lifecycle ------------------------------------------------------------------------------

    async def register(self) -> None:
        """Record every plan of the registry, so pins and signal names can be checked anywhere."""
        for wf in self.registry:
            await self.store.register(pin_of(wf), wf.plan.document())

    async def start(self) -> None:
        await self.register()
        await self._open_listener()
        self._loops = [
            asyncio.create_task(self._claim_loop(), name="stepstone-claim"),
            asyncio.create_task(self._lease_loop(), name="stepstone-lease"),
        ]

    async def stop_claiming(self) -> None:
        """Claim nothing more. A claim statement already sent is let finish, so the commands it
        claimed become segments that drain (or are released) instead of waiting out their lease."""
        self._stopping = True
        self._wake.set()
        self._slot_free.set()
        claim_loop = self._loops[0] if self._loops else None
        if claim_loop is not None and not claim_loop.done():
            done, _ = await asyncio.wait({claim_loop}, timeout=_CLAIM_LOOP_EXIT_SECONDS)
            if not done:  # stuck on an unresponsive database: its claims will expire
                claim_loop.cancel()
            await asyncio.gather(claim_loop, return_exceptions=True)

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Stop claiming, let in-flight steps finish up to the drain timeout, release the rest."""
        await self.stop_claiming()
        timeout = self.config.drain_timeout if drain_timeout is None else drain_timeout
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for seg in list(self._segments.values()):
            try:
                if await self.store.release(seg.instance_id, seg.token):
                    await self.events.bump("released")
            except DatabaseUnavailable:
                log.warning("could not release instance %s; its lease will expire", seg.instance_id)
        self._segments.clear()
        for loop in self._loops[1:]:
            loop.cancel()
        await asyncio.gather(*self._loops[1:], return_exceptions=True)
        await self._close_listener()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run_until_idle(self) -> None:
        """Claim and run until nothing is claimable now (for tests, scripts and the demo)."""
        while True:
            free = self.config.concurrency - len(self._tasks)
            claims = []
            if free > 0:
                claims = await self.store.claim(free, self.config.lease_seconds, self.config.worker_id)
            if not claims and not self._tasks:
                return
            for claim in claims:
                self._spawn(claim)
            if self._tasks:
                await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)

    # -- the loops ------------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        failures = 0
        last_claim = 0.0
        while not self._stopping:
            free = self.config.concurrency - len(self._tasks)
            if free <= 0:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            self._wake.clear()
            try:
                if self._listener is None or not self._listener.alive:
                    await self._open_listener()
                last_claim = asyncio.get_running_loop().time()
                claims = await self.store.claim(free, self.config.lease_seconds, self.config.worker_id)
                failures = 0
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any single failure
                failures += 1
                delay = min(5.0, 0.1 * 2**failures) * random.uniform(0.5, 1.0)  # noqa: S311 - jitter
                log.warning("claim failed (%s: %s); retrying in %.2f s", type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
                continue
            for claim in claims:
                self._spawn(claim)
            if len(claims) == free:
                continue
            delay = self.config.poll_interval
            if not claims:
                try:
                    upcoming = await self.store.next_available()
                except Exception:  # noqa: BLE001 - polling covers it
                    upcoming = None
                if upcoming is not None:
                    delay = min(delay, max(upcoming, 0.001))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
            if not claims:  # coalesce a flood of wake-ups after an empty claim: one claim per interval
                await asyncio.sleep(last_claim + self.config.min_wake_interval - asyncio.get_running_loop().time())

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_seconds / 3)
            held = {s.instance_id: s.token for s in self._segments.values() if not s.lost}
            if not held:
                continue
            try:
                kept = await self.store.renew(held, self.config.lease_seconds)
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any single failure
                log.warning("lease renewal failed (%s: %s)", type(exc).__name__, exc)
                continue
            for instance_id in held.keys() - kept:
                seg = self._segments.get(instance_id)
                if seg is not None:
                    seg.lost = True
                    log.warning("lost the lease on instance %s; its segment will be abandoned", instance_id)

    async def _open_listener(self) -> None:
        try:
            self._listener = await self.store.listen(self._wake.set)
        except DatabaseUnavailable as exc:
            self._listener = None
            log.warning("wake-up connection unavailable (%s); polling every %.1f s",
                        type(exc).__name__, self.config.poll_interval)

    async def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                await listener.close()
            except (DatabaseUnavailable, OSError, asyncpg.InterfaceError) as exc:
                log.debug("wake-up connection already gone (%s)", type(exc).__name__)

    # -- segments -------------------------------------------------------------------------------

    def _spawn(self, claim: Claim) -> None:
        self._segments[claim.instance.id] = _Segment(claim.instance.id, claim.token)
        task = asyncio.create_task(self._guarded(claim), name=f"stepstone-segment-{claim.instance.id}")
        self._tasks.add(task)
        task.add_done_callback(self._segment_done)

    def _segment_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slot_free.set()

    async def _guarded(self, claim: Claim) -> None:
        """Run a segment; a crash stops renewing its lease, so another claim retries it (and a
        command that keeps crashing is dead-lettered after max_claims)."""
        try:
            await self._segment(claim)
        except asyncio.CancelledError:
            raise  # drain: stop() releases what is still held
        except Exception:
            log.exception("segment of instance %s crashed; its lease will expire", claim.instance.id)
            self._segments.pop(claim.instance.id, None)
            await self.events.bump("crashed")

    async def _segment(self, claim: Claim) -> None:
        await self.events.bump("claims")
        workflow = self.registry.find(claim.pin.definition_id, claim.pin.version, claim.pin.plan_hash)
        if workflow is None:
            reason = (f"NOT_RUNNABLE: this node has no plan {claim.pin.definition_id} v{claim.pin.version} "
                      f"{claim.pin.plan_hash[:12]}")
            await self.store.defer(claim.instance.id, claim.token, reason)
            self._segments.pop(claim.instance.id, None)
            await self.events.bump("deferred")
            return
        instance, command, now = claim.instance, claim.command, claim.now
        while True:
            outcome = apply(instance, command, workflow.plan, now, self.config.max_claims)
            visit = instance.visit
            if isinstance(outcome, RunStep):
                signal = command.payload.get("signal") if isinstance(command.payload, dict) else None
                result = await run_handler(
                    workflow, instance, outcome, signal=signal, executor=self._executor, limits=self.limits
                )
                decision = complete_step(instance, command, workflow.plan, result, now)
                visit = outcome.visit
            else:
                decision = outcome
            committed = await self._commit(claim, command.id, decision, visit)
            if committed is None:
                self._segments.pop(claim.instance.id, None)
                await self.events.bump("fenced")
                return
            await self.events.bump("commits")
            follow = decision.continuation
            if follow is None or committed.continuation is None or self._stopping:
                if follow is None or committed.continuation is None:
                    self._segments.pop(claim.instance.id, None)
                return
            instance = advance(instance, decision.instance)
            command = CommandView(committed.continuation, "STEP", follow.step, follow.visit, None, follow.payload)
            now = committed.committed_at

    async def _commit(self, claim: Claim, command_id: int, decision: Decision, visit: int) -> Committed | None:
        """Commit fenced; when the outcome is unknown (connection lost), re-read instead of guessing."""
        delay = 0.05
        while True:
            try:
                return await self._committer.commit(CommitRequest(claim, command_id, decision, visit))
            except DatabaseUnavailable as exc:
                log.warning("commit of instance %s interrupted (%s); re-reading", claim.instance.id, exc)
            while True:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                try:
                    held = await self.store.held_command(claim.instance.id, claim.token)
                    break
                except DatabaseUnavailable:
                    continue
            if held == command_id:
                continue  # not committed and still ours: commit again
            if held is not None:
                return Committed(held, await self.store.db_now())  # committed with a continuation
            if await self.store.settled_by(command_id, claim.token):
                return Committed(None, await self.store.db_now())  # committed; the instance waits or ended
            return None  # never committed, and the lease is gone: fenced


def pin_of(workflow: Workflow[Any], scope: str = "default") -> Pin:
    plan = workflow.plan
    return Pin(scope, plan.definition_id, plan.version, plan.plan_hash)
