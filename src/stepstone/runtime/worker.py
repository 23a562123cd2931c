"""The worker service: claims commands, runs segments, keeps leases, drains on stop.

    claim loop   claims up to the free slots in one statement, spawns a segment per claim,
                 then sleeps until a notification, the earliest future availability or
                 the poll interval, whichever comes first
    segment      apply -> handler (outside any transaction) -> fenced commit, and on
                 through continuations already claimed by the same commit
    lease loop   renews every held lease at TTL/3 in one statement; a lease it can no
                 longer renew marks its segment lost (its commit will be refused)
    waker        one dedicated LISTEN connection; polling covers its absence; when to claim
                 again after a notification: runtime/wakeups.py

Tests wait on `WorkerEvents`, never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Any

from stepstone._waiting import wait_set
from stepstone.authoring.workflow import Registry, Workflow
from stepstone.context import durable
from stepstone.core.effects import StartChild
from stepstone.core.folding import fold, foldable
from stepstone.core.limits import Limits
from stepstone.core.model import CommandView, Decision, InstanceView, RunStep, Settle
from stepstone.core.pin import pin_of  # kept importable from here for callers and tests (__all__)
from stepstone.core.saga import SAGA, RunCompensation, complete_compensation
from stepstone.core.transitions import advance, apply, complete_step, reports_wanted
from stepstone.errors import ClientClosed, DatabaseUnavailable, InsufficientPrivilege, VersionNotAdmitted
from stepstone.runtime import external_state, observe, serving
from stepstone.runtime.alone import AloneRuns, wait_for_the_others
from stepstone.runtime.committer import GroupCommitter, commit_fenced
from stepstone.runtime.compensations import raise_alert, run_compensation
from stepstone.runtime.handlers import ChildVersions, describe_error, run_handler
from stepstone.runtime.outage import ClaimOutage
from stepstone.runtime.scheduler import ScheduleFirer
from stepstone.runtime.threads import HandlerThreads
from stepstone.runtime.wakeups import WakeUps
from stepstone.runtime.worker_config import WorkerConfig, WorkerEvents
from stepstone.store.port import Claim, CommitRequest, Committed, Listener, WorkerStore
from stepstone.store.scheduling_port import SchedulingStore

__all__ = ["Worker", "WorkerConfig", "WorkerEvents", "pin_of"]

_COALESCE_CLAIMS = 0.002
"""While the queue is deep (the last claim filled every free slot) and fewer than half the slots are free,
the claim loop waits this long once before claiming, so that segments ending at about the same time go
out in one claim. Without it a saturated worker fell, in some runs, into claiming one or two commands at
a time (0.3-0.5 claim statements a three-step workflow instead of 0.25), and stayed there
(docs/performance-history.md, "Claims that wait for a second slot"). A worker with few slots, or one that is not
saturated, never waits."""

log = logging.getLogger("stepstone.worker")


_CLAIM_LOOP_EXIT_SECONDS = 10.0
_MAX_STATE_CONFLICTS = 50
# What stopping tolerates from the store: an outage, or a store its owner closed before stopping the worker.
_GONE = (DatabaseUnavailable, ClientClosed)
_JOIN_BATCH = 500
"""Branch reports a join takes in one commit at most, beside the one it claimed: a commit document of
about 50 kB at the most (a history entry each)."""


@dataclass
class _Segment:
    instance_id: str
    position: str
    token: Any
    lost: bool = False
    # Its last commit is in flight: that commit releases the lease, so a renewal that crosses it finds the
    # lease gone without anything being lost.
    ending: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return self.instance_id, self.position


class Worker:
    """Runs the commands of the workflows in `registry`, `config.concurrency` at a time."""

    def __init__(
        self,
        store: WorkerStore,
        registry: Registry,
        config: WorkerConfig | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.store = store
        self.registry = registry
        self.config = config or WorkerConfig()
        self.limits = limits or Limits()
        self.events = WorkerEvents()
        self._segments: dict[tuple[str, str], _Segment] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._finished = 0  # segments ended, so run_until_idle can tell a claim raced one
        self._wakeups = WakeUps(self.config)
        self._wake = self._wakeups.event
        self._slot_free = asyncio.Event()
        # A segment whose last commit is in flight (`_Segment.ending`) holds a slot that is as good as free,
        # so the claim loop claims for it while that commit's round trip runs instead of after it
        # (`_decide_and_commit`). What it claims waits for a slot (`_slots`) before it runs anything: at
        # most `concurrency` segments run or wait for their commit at once, so a kill repeats at most that
        # many effects.
        self._slots = asyncio.Semaphore(self.config.concurrency)
        self._alone = AloneRuns()  # a command a dead worker held runs alone (runtime/alone.py)
        self._stopping = False
        self._loops: list[asyncio.Task[None]] = []
        self._listener: Listener | None = None
        self._outage = ClaimOutage()
        self._executor = HandlerThreads(self.config.concurrency)
        self._stopped = False
        self._committer = GroupCommitter(
            store, lease_seconds=self.config.lease_seconds, worker=self.config.worker_id
        )
        self.schedules = (ScheduleFirer(store, registry, store.definitions) if isinstance(store, SchedulingStore)
                          else None)
        self._registered = False

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    @property
    def alive(self) -> bool:
        """The claim loop runs, or the worker drains after a stop (the liveness probe)."""
        return bool(self._loops) and (not self._loops[0].done() or (self._stopping and not self._stopped))

    @property
    def claiming(self) -> bool:
        """It takes new work: started, and not stopping (part of the readiness probe)."""
        return bool(self._loops) and not self._stopping

    @property
    def registered(self) -> bool:
        """Every plan of the registry is recorded in the database (part of the readiness probe)."""
        return self._registered

    @property
    def served(self) -> list[str]:
        """The keys this worker claims work of (read per claim: a registry may grow): the definition ids it
        serves, then the route of each pin it has, under which a command deferred for want of its plan
        waits for a worker that has the plan (migration 0076)."""
        return sorted(self.registry.definition_ids) + sorted({pin.route for pin in serving.served_pins(self.registry)})

    # -- lifecycle ------------------------------------------------------------------------------

    async def register(self) -> None:
        """Record every plan of the registry, so pins and signal names can be checked anywhere; a version
        whose structure changed without a version bump raises DefinitionDrift."""
        self.registry.check_children()
        await serving.record_definitions(self.store.definitions, self.registry)
        self._registered = True

    async def start(self) -> None:
        await self.register()
        pins = serving.served_pins(self.registry)
        await serving.announce(self.store.definitions, self.config.worker_id, pins)
        await self._open_listener()
        self._loops = [
            asyncio.create_task(self._claim_loop(), name="stepstone-claim"),
            asyncio.create_task(self._lease_loop(), name="stepstone-lease"),
            asyncio.create_task(self._statistics_loop(), name="stepstone-statistics"),
            asyncio.create_task(serving.heartbeat_loop(self.store.definitions, self.config.worker_id, pins,
                                                       self.config.heartbeat_seconds), name="stepstone-heartbeat"),
        ]
        if self.schedules is not None:
            self._loops.append(asyncio.create_task(
                self.schedules.run(lambda: self._stopping, self.config.schedule_interval), name="stepstone-schedules"))

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

    @property
    def abandoned_threads(self) -> int:
        """After `stop`, how many synchronous handlers are still running in their threads.

        A thread cannot be interrupted, so such a handler runs on until it returns; its claim was
        released and its result is dropped. The threads are daemon threads: they never keep the
        process from exiting, so an embedding app (or `stepstone worker`) exits normally.
        """
        return self._executor.busy if self._stopped else 0

    async def stop(self, drain_timeout: float | None = None) -> int:
        """Stop claiming, let in-flight steps finish up to the drain timeout, release the rest.

        Returns `abandoned_threads`: the synchronous handlers still running after the drain
        (0 when every step finished or was cancelled)."""
        await self.stop_claiming()
        timeout = self.config.drain_timeout if drain_timeout is None else drain_timeout
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for seg in list(self._segments.values()):
            try:
                if await self.store.release(seg.instance_id, seg.position, seg.token):
                    self.events.count("released")
            except _GONE:
                log.warning("could not release instance %s; its lease will expire", seg.instance_id)
        self._segments.clear()
        for loop in self._loops[1:]:
            loop.cancel()
        await asyncio.gather(*self._loops[1:], return_exceptions=True)
        await self._close_listener()
        if self._loops:  # started: it no longer serves its pins
            with contextlib.suppress(*_GONE):
                await self.store.definitions.forget_worker(self.config.worker_id)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._stopped = True
        if self.abandoned_threads:
            log.warning("%d synchronous step handler(s) still running after the drain timeout; their claims "
                        "were released and their threads will not keep the process alive", self.abandoned_threads)
        return self.abandoned_threads

    async def run_until_idle(self) -> None:
        """Fire due schedules, then claim and run until nothing is claimable now (for tests, scripts and
        the demo)."""
        if self.schedules is not None:
            await self.schedules.fire_due()
        while True:
            free = self.config.concurrency - len(self._tasks)
            finished = self._finished
            claims = []
            if free > 0 and not self._alone.active:
                claims = await self.store.claim(free, self.config.lease_seconds, self.config.worker_id,
                                                 self.served)
            if not claims and not self._tasks:
                if self._finished != finished:
                    continue  # a segment ended during the claim: its commit may have queued work it missed
                return
            await self._take(claims)
            if self._tasks:
                await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)

    # -- the loops ------------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        outage = self._outage
        last_claim = 0.0
        queue_deep = coalesced = False  # the last claim filled every free slot: more work is likely waiting
        while not self._stopping:
            free = self.config.concurrency - len(self._tasks) + sum(s.ending for s in self._segments.values())
            if free <= 0 or self._alone.active:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            if queue_deep and free < self.config.concurrency // 2 and not coalesced:
                coalesced = True  # let the segments ending beside this one free their slots too, then claim
                await asyncio.sleep(_COALESCE_CLAIMS)
                continue
            coalesced = False
            self._wake.clear()
            try:
                if self._listener is None or not self._listener.alive:
                    await self._open_listener()
                last_claim = asyncio.get_running_loop().time()
                claims = await self.store.claim(free, self.config.lease_seconds, self.config.worker_id,
                                                 self.served)
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any single failure
                await asyncio.sleep(outage.failed(exc, asyncio.get_running_loop().time()))
                continue
            outage.worked(asyncio.get_running_loop().time())
            await self._take(claims)
            queue_deep = len(claims) == free
            if queue_deep:
                continue
            delay = self.config.poll_interval
            if not claims:
                try:
                    upcoming = await self.store.next_available(self.served)
                except Exception:  # noqa: BLE001 - polling covers it
                    upcoming = None
                if upcoming is not None:
                    delay = min(delay, max(upcoming, 0.001))
            await wait_set(self._wake, delay)
            if not claims:  # coalesce a flood of wake-ups after an empty claim: one claim per interval
                await asyncio.sleep(last_claim + self.config.min_wake_interval - asyncio.get_running_loop().time())

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_seconds / 3)
            await self._renew_held()
            self.events.count("lease_rounds")

    async def _renew_held(self) -> None:
        held = {s.key: s.token for s in self._segments.values() if not (s.lost or s.ending)}
        if not held:
            return
        try:
            kept = await self.store.renew(held, self.config.lease_seconds)
        except Exception as exc:  # noqa: BLE001 - the loop must outlive any single failure
            log.warning("lease renewal failed (%s: %s)", type(exc).__name__, exc)
            return
        for key in held.keys() - kept:
            seg = self._segments.get(key)
            if seg is not None and not seg.ending:
                seg.lost = True
                log.warning("lost the lease on instance %s position %r; its segment will be abandoned", *key)

    async def _statistics_loop(self) -> None:
        """While the engine's tables are young, analyze them when they have grown: first at 1,000 rows,
        then whenever one has doubled since, until each was analyzed with 100,000 rows. The plans a young
        database's statements keep are made for the size its tables had at the last ANALYZE; autovacuum's
        comes within its nap time (a minute by default), and until then a claim read and sorted the whole
        backlog, or read all of `commands` to re-check the few it took (docs/performance-history.md, "Plans made
        on empty tables", "Plans of a young database")."""
        while True:
            await asyncio.sleep(self.config.statistics_interval)
            try:
                if await self.store.refresh_statistics():
                    return
            except InsufficientPrivilege as exc:
                log.info("not analyzing the engine's tables (%s); autovacuum will", exc)
                return
            except DatabaseUnavailable:  # the claim loop says so; this loop keeps looking, quietly
                continue
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any single failure
                log.warning("statistics check failed (%s: %s)", type(exc).__name__, exc)

    async def _open_listener(self) -> None:
        try:
            self._listener = await self.store.listen_due(self._on_due)
        except DatabaseUnavailable as exc:
            self._listener = None
            log.log(logging.DEBUG if self._outage.failures else logging.WARNING,  # the claim loop tells an outage
                    "wake-up connection unavailable (%s); polling every %g s",
                    type(exc).__name__, self.config.poll_interval)

    def _on_due(self, due_in: float, definition: str | None = None) -> None:
        """A notification: wake up for it unless it names a workflow this worker does not serve (every
        pool of a fleet split by workflow woke for every other pool's commands, for an empty claim)."""
        if definition is None or definition in self.registry.definition_ids or (
                "@" in definition and definition in self.served):  # a route: a deferred command's
            self._wakeups.notified(due_in)

    async def _close_listener(self) -> None:
        self._wakeups.forget()
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                await listener.close()
            except (*_GONE, OSError) as exc:
                log.debug("wake-up connection already gone (%s)", type(exc).__name__)

    # -- segments -------------------------------------------------------------------------------

    async def _take(self, claims: list[Claim]) -> None:
        """Run what was claimed, but a command a dead worker held only alone: others are given back."""
        run, give_back = self._alone.sort(claims)
        for claim in give_back:  # first: what is given back is not held should the suspect kill the process
            with contextlib.suppress(*_GONE):  # else its lease expires, as after any crash
                await self.store.release(claim.instance.id, claim.instance.position, claim.token)
        for claim in run:
            self._spawn(claim)

    def _spawn(self, claim: Claim) -> None:
        seg = _Segment(claim.instance.id, claim.instance.position, claim.token)
        self._segments[seg.key] = seg
        task = asyncio.create_task(self._guarded(claim), name=f"stepstone-segment-{claim.instance.id}")
        self._tasks.add(task)
        task.add_done_callback(self._segment_done)

    def _segment_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._finished += 1
        self._slot_free.set()

    def _forget(self, claim: Claim) -> None:
        self._segments.pop((claim.instance.id, claim.instance.position), None)

    async def _guarded(self, claim: Claim) -> None:
        """Run a segment; a crash stops renewing its lease, so another claim retries it (and a
        command that keeps crashing is dead-lettered after max_claims)."""
        try:
            if self._alone.is_alone(claim):
                await wait_for_the_others(self._tasks)
            async with self._slots:
                await self._segment(claim)
        except asyncio.CancelledError:
            raise  # drain: stop() releases what is still held
        except BaseException as exc:  # no segment may take the worker down
            log.exception("segment of instance %s crashed; its lease will expire", claim.instance.id)
            self._forget(claim)
            await self._note_crash(claim, exc)
            self.events.count("crashed")
        finally:
            self._end_alone(claim)

    def _end_alone(self, claim: Claim) -> None:
        if self._alone.end(claim):
            self._slot_free.set()  # the claim loop claims again

    async def _note_crash(self, claim: Claim, exc: BaseException) -> None:
        try:
            await self.store.note_error(claim.instance.id, claim.token, f"segment crashed: {describe_error(exc)}")
        except Exception as note_exc:  # noqa: BLE001 - the lease expiring is the recovery; this is a note
            log.debug("could not record the crash of instance %s (%s)", claim.instance.id, type(note_exc).__name__)

    async def _segment(self, claim: Claim) -> None:
        self.events.count("claims")
        workflow = self.registry.find(claim.pin.definition_id, claim.pin.version, claim.pin.plan_hash)
        if workflow is None:
            reason = (f"NOT_RUNNABLE: this node has no plan {claim.pin.definition_id} v{claim.pin.version} "
                      f"{claim.pin.plan_hash[:12]}")
            await self.store.defer(claim.instance.id, claim.instance.position, claim.token, reason)
            self._forget(claim)
            self.events.count("deferred")
            return
        instance, command, now = claim.instance, claim.command, claim.now
        if self._alone.is_alone(claim):  # marked: a crash from here on counts on it (core/dead_letter.py)
            earlier = await self.store.run_alone(instance.id, instance.position, claim.token)
            if earlier is None:  # its lease is gone
                self._forget(claim)
                self.events.count("fenced")
                return
            command = replace(command, alone_claims=earlier)
        observe.claimed(claim.pin.definition_id, command, claim.now, claim.instance_created_at)
        # The reports queued behind a join's report may join in the same commit; no round trip when the
        # join needs none of them (this report completes it, or it is not one the join waits for).
        if wanted := min(reports_wanted(instance, command), _JOIN_BATCH):
            queued = await self.store.queued_behind(instance.id, instance.position, command.id, wanted)
            command = replace(command, behind=queued.commands)
            if queued.commands:
                # Their branches committed after this claim read the state: the join and the step it enters
                # decide on a state that holds those branches' changes, read with the reports.
                instance = replace(instance, state=queued.state, state_version=queued.state_version)
        while True:
            decided_on, decision, committed = await self._decide_and_commit(claim, workflow, instance, command, now)
            if committed is None:
                self._forget(claim)
                self.events.count("fenced")
                return
            self.events.count("commits")
            self._end_alone(claim)  # its step committed: it did not kill the process
            follow = decision.continuation
            if follow is None or committed.continuation is None or self._stopping:
                if follow is None or committed.continuation is None:
                    self._forget(claim)
                return
            # From the instance the decision was made on: after a conflict that is the state the commit
            # returned, not the one this segment was claimed with.
            instance = advance(decided_on, decision, committed.state_version)
            # The change was carried onto a newer state, or the decision wrote none and another position
            # moved the state on meanwhile (migration 0037): go on from the state the commit returned.
            if committed.state is not None:
                instance = replace(instance, state=committed.state)
            command = CommandView(committed.continuation, "STEP", follow.step, follow.visit, None, follow.payload,
                                  actor=command.actor)
            now = committed.committed_at

    async def _decide_and_commit(
        self, claim: Claim, workflow: Workflow[Any], instance: InstanceView, command: CommandView, now: Any,
        transition: Decision | None = None,
    ) -> tuple[InstanceView, Decision, Committed | None]:
        """Decide, run the handler if the step has one, and commit; returns the instance view the
        committed decision was made on, the decision and its commit. When another position changed the
        shared state first, the commit carries this change onto the current state when the two touch
        different parts of it; when they touch the same part, the step runs again on the current state
        (its effects may repeat, as after any retry).

        `transition`: the uncommitted decision that entered this step (`core.folding`); the step's
        decision is committed with it as one, or after it when the step does not complete."""
        children = ChildVersions(self.store, self.registry, claim.pin.scope, command.kind == "RETRY")
        for _ in range(_MAX_STATE_CONFLICTS):
            with durable.bound(claim.context):  # the caller's trace and registered values (stepstone.context)
                decided = await self._decide(claim, workflow, instance, command, now, children)
                if decided is None:
                    return instance, Decision(Settle("COMPLETE")), None
                decision, visit, handled = decided
                if transition is None and not handled and foldable(decision) and not self._stopping:
                    entered = self._entered_step(workflow, instance, command, now, decision)
                    if entered is not None:
                        return await self._decide_and_commit(claim, workflow, *entered, now, decision)
                if transition is not None:
                    folded = fold(transition, decision)
                    if folded is None:  # the step retries or fails under a command of its own: the transition first
                        first = await self._observed_commit(claim, instance, command.id, transition, visit,
                                                            instance.state_version)
                        if first is None or first.continuation is None:
                            return instance, transition, first
                        self.events.count("commits")
                        command, transition = replace(command, id=first.continuation), None
                    else:
                        decision = folded  # on a conflict the step runs again and folds again
                try:
                    committed = await self._observed_commit(claim, instance, command.id, decision, visit,
                                                            instance.state_version)
                except VersionNotAdmitted:  # the child's version, deprecated since its selection: nothing was
                    if decision.first(StartChild) is None:  # written and the claim holds; select again, without
                        raise  # running the handler again (`ChildVersions.ran`)
                    log.info("instance %s: the child's version, deprecated since, is selected again", instance.id)
                    continue
            if committed is not None and not committed.conflict:
                await raise_alert(self.config.on_compensation_failed, decision)
            if committed is None or not committed.conflict:
                return instance, decision, committed
            self.events.count("conflicts")
            instance = replace(instance, state=committed.state, state_version=committed.state_version)
        raise RuntimeError(f"instance {instance.id}: the shared state kept changing under the step; giving up")

    async def _decide(
        self, claim: Claim, workflow: Workflow[Any], instance: InstanceView, command: CommandView, now: Any,
        children: ChildVersions,
    ) -> tuple[Decision, int, bool] | None:
        """The decision (redacted), the visit that names its events, and whether a handler (a step's or
        a compensation's) ran for it; None when a compensation finds its lease gone. Only a decision no
        handler ran for is a transition that may fold: a step's completion always commits before the
        next step runs, so a crash repeats at most the one step in flight."""
        outcome = apply(instance, command, workflow.plan, now, self.config.max_claims)
        visit = command.id if instance.position == SAGA else instance.visit  # every '$saga' command is visit 1
        if isinstance(outcome, RunStep):
            cause = command.payload if isinstance(command.payload, dict) else None
            with observe.step(workflow, instance, outcome, command) as seen:
                result = await run_handler(workflow, instance, outcome, cause=cause, executor=self._executor,
                                           limits=self.limits, children=children)
                seen.result(result)
            decision = complete_step(instance, command, workflow.plan, result, now)
            visit = outcome.visit
        elif isinstance(outcome, RunCompensation):
            # A worker that lost its lease never runs a compensation: another may be running it.
            if not await self.store.holds_lease(instance.id, instance.position, claim.token):
                return None
            compensated = await run_compensation(workflow, instance, outcome, executor=self._executor,
                                                  limits=self.limits)
            decision = complete_compensation(instance, workflow.plan, outcome, compensated)
            visit = command.id  # the events of each compensation command get ids of their own
        else:
            decision = external_state.checked(workflow, instance, command, outcome)
        handled = not isinstance(outcome, Decision)
        return workflow.redaction.decision(decision, instance.state, command), visit, handled  # never the live state

    def _entered_step(
        self, workflow: Workflow[Any], instance: InstanceView, command: CommandView, now: Any, transition: Decision
    ) -> tuple[InstanceView, CommandView] | None:
        """The instance and command of the step a plain transition enters, when that step runs a handler:
        it runs at once and commits with the transition (`core.folding`), under the claimed command."""
        follow = transition.continuation
        assert follow is not None  # foldable
        entered = advance(instance, transition, instance.state_version)
        step = CommandView(command.id, "STEP", follow.step, follow.visit, None, follow.payload, actor=command.actor)
        if not isinstance(apply(entered, step, workflow.plan, now, self.config.max_claims), RunStep):
            return None
        return entered, step

    async def _observed_commit(
        self, claim: Claim, instance: InstanceView, command_id: int, decision: Decision, visit: int,
        state_version: int,
    ) -> Committed | None:
        # While the commit that ends a segment is in flight its slot counts as free: the next claim goes
        # out beside that commit instead of one round trip after it (docs/performance-history.md, "Claims beside
        # the last commit"); what it claims starts once this segment gives the slot back (`_slots`).
        ending = decision.continuation is None
        segment = self._segments.get((claim.instance.id, claim.instance.position))
        if segment is not None:
            segment.ending = ending
        if ending:
            self._slot_free.set()
        with observe.commit(instance, decision, claim.pin.definition_id) as seen_commit:
            try:
                committed = await self._commit(claim, command_id, decision, visit, state_version)
            except VersionNotAdmitted:
                if segment is not None:
                    segment.ending = False  # nothing was written and the step runs again: keep renewing
                raise
            seen_commit.result(committed)
        if committed is not None and not committed.conflict:  # which level its failure's line takes
            await observe.branch_failure(self.store, claim.pin.definition_id, instance, decision)
        if segment is not None and committed is not None and committed.conflict:
            segment.ending = False  # the step runs again on fresh state; the lease is still held
        return committed

    async def _commit(
        self, claim: Claim, command_id: int, decision: Decision, visit: int, state_version: int
    ) -> Committed | None:
        return await commit_fenced(self._committer, self.store, CommitRequest(claim, command_id, decision, visit,
                                                                              state_version))
