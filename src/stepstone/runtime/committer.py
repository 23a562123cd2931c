"""Group commit: the commits of concurrent segments flushed together.

While one flush is in flight, the commits that become ready queue up; the next
flush sends all of them as one statement in one transaction (one WAL flush
instead of one per step). At low load a commit goes alone, with no added wait.
A segment learns its result only after the transaction holding its commit has
committed, so durability is exactly that of a single commit.

A child instance's commit is never grouped. A group locks its instances in id
order and holds each lock until it commits; a cancel (or a deadline, a join)
takes a parent, then its children. A group holding a child while it waits for
that child's parent, a later item, closes a cycle with such a cancel: PostgreSQL
aborts one of them (the saga lock-order test saw it). A child's own commit locks
only the child, so alone it cannot be part of that cycle.

Nor is a commit that enters a wait taking messages (a `Subscribe` effect): it
locks its correlation keys after its instance row, the lock order, so in a group
it would hold a key while it waits for a later item's row, and two groups
[A (key k2), B (k1)] and [C (k1), D (k2)] close a cycle on the keys
(tests/engine/test_messages.py). Alone, it takes its keys last, in one sorted
batch, as every other holder of a key does. A commit that settles a buffered
message's command untaken (the message goes on under its key's lock) is grouped:
commit_decisions hands such messages on after its last item, in key order
(migration 0077), so a group takes no key before all its instance rows.
"""

from __future__ import annotations

import asyncio
import logging

from stepstone.core.effects import SetState, Subscribe
from stepstone.core.model import Decision
from stepstone.errors import DatabaseUnavailable
from stepstone.runtime.outage import until_reachable
from stepstone.store.port import CommitRequest, Committed, HeldCommand, WorkerStore

log = logging.getLogger("stepstone.worker")


class GroupCommitter:
    def __init__(self, store: WorkerStore, *, lease_seconds: float, worker: str, max_batch: int = 64) -> None:
        self.store = store
        self.lease_seconds = lease_seconds
        self.worker = worker
        self.max_batch = max_batch
        self._queue: list[tuple[CommitRequest, asyncio.Future[Committed | None]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def commit(self, request: CommitRequest) -> Committed | None:
        """Commit fenced; None when the claim's token was refused."""
        future: asyncio.Future[Committed | None] = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._drain_queue(), name="stepstone-commit")
        return await future

    async def _drain_queue(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                await self._flush(batch)
        finally:
            self._flusher = None

    async def _flush(self, batch: list[tuple[CommitRequest, asyncio.Future[Committed | None]]]) -> None:
        alone: list[tuple[CommitRequest, asyncio.Future[Committed | None]]] = []
        grouped: list[tuple[CommitRequest, asyncio.Future[Committed | None]]] = []
        for item in batch:
            (alone if _alone(item[0]) else grouped).append(item)
        for request, future in alone:  # first: see the module's docstring
            await self._flush_one(request, future)
        batch = grouped
        if len(batch) <= 1:
            for request, future in batch:
                await self._flush_one(request, future)
            return
        requests = [request for request, _ in batch]
        try:
            results = await self.store.commit_many(requests, lease_seconds=self.lease_seconds, worker=self.worker)
        except DatabaseUnavailable as exc:
            for _, future in batch:
                _fail(future, exc)
            return
        except Exception as exc:  # noqa: BLE001 - one bad item must not sink the others: commit them one by one
            log.warning("group commit of %d failed (%s); committing one by one", len(batch), type(exc).__name__)
            for request, future in batch:
                await self._flush_one(request, future)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def _flush_one(self, request: CommitRequest, future: asyncio.Future[Committed | None]) -> None:
        try:
            result = await self.store.commit(request, lease_seconds=self.lease_seconds, worker=self.worker)
        except Exception as exc:  # noqa: BLE001 - handed to the waiting segment
            _fail(future, exc)
            return
        if not future.done():
            future.set_result(result)


def _alone(request: CommitRequest) -> bool:
    """A child's commit, or one that opens message subscriptions: never grouped (the module's docstring)."""
    return request.claim.instance.parent is not None or any(
        isinstance(effect, Subscribe) for effect in request.decision.effects)


def _fail(future: asyncio.Future[Committed | None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


async def commit_fenced(committer: GroupCommitter, store: WorkerStore, request: CommitRequest) -> Committed | None:
    """Commit fenced (None: fenced); when the outcome is unknown (connection lost), re-read instead of
    guessing, and commit again only when the read says it did not happen and the claim still holds."""
    while True:
        try:
            return await committer.commit(request)
        except DatabaseUnavailable as exc:
            log.warning("commit of instance %s interrupted (%s); re-reading", request.claim.instance.id, exc)
        outcome = await outcome_of(store, request)
        if not isinstance(outcome, CommitAgain):
            return outcome


class CommitAgain:
    """outcome_of's answer when the commit did not happen and the claim still holds: commit it again."""


async def outcome_of(store: WorkerStore, request: CommitRequest) -> Committed | CommitAgain | None:
    """What became of a commit whose outcome is unknown (its connection was lost), read back, never guessed:
    the commit when it happened, None when it did not and the lease is gone (fenced), or CommitAgain. The
    reads are asked again, with backoff, while the database is unreachable, all of them: when only the first
    was, a cut under a later one crashed the segment, its step ran again after the lease and nothing said
    the first run had been fenced (three repeated effects the chaos rig's cuts could not explain)."""
    await asyncio.sleep(0.05)  # the connection was just lost: a moment before the first read
    return await until_reachable(lambda: _read_outcome(store, request))


async def _read_outcome(store: WorkerStore, request: CommitRequest) -> Committed | CommitAgain | None:
    claim, decision = request.claim, request.decision
    held = await store.held_command(claim.instance.id, claim.instance.position, claim.token)
    if held is not None and held.id == request.command_id and not went_on_in(held, decision):
        return CommitAgain()  # not committed and still ours
    if held is not None:
        # Committed, with a continuation. The version is a lower bound: a stale one only costs a rebase.
        bumped = request.state_version + (1 if decision.first(SetState) is not None else 0)
        return Committed(held.id, await store.db_now(), bumped)
    if await store.settled_by(request.command_id, claim.token):
        return Committed(None, await store.db_now())  # committed; the position waits or ended
    return None  # never committed, and the lease is gone: fenced


def went_on_in(held: HeldCommand, decision: Decision) -> bool:
    """Whether the held command now names the decision's continuation: the commit went on in the claimed
    row (migration 0030). Before the commit the row names an earlier visit, since a continuation always
    enters its step on a visit of its own."""
    follow = decision.continuation
    return follow is not None and (held.step, held.visit) == (follow.step, follow.visit)
