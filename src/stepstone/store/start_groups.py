"""Group start: concurrent single starts of one workflow version sent as one statement.

`Client.start` is one statement per instance. When callers start instances of the same version
concurrently (web requests, a worker's own starts, the throughput bench's starters), the starts that
arrive while one is in flight queue up and the next flush sends them together through `start_batch`,
the statement behind `start_many`: one round trip, one transaction and one WAL flush for the group.
A start that finds nothing in flight goes alone, through the single-start statement, sent by its
caller with nothing in between; so a lone caller sees exactly what it saw before.

Each caller still gets its own outcome. The group is one transaction, so an item the batch refuses
(a business key in use, an idempotency key used with other input) would fail the others: on any
refusal the group is started again one by one, and each caller gets what its own start would have
given it. Durability is a single start's: a caller learns its id only after the group committed.
Starts with a durable context or a deadline are not grouped (they are rare, and the key would grow).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from stepstone.errors import DatabaseUnavailable
from stepstone.store.port import NewInstance, NewInstances, Pin

__all__ = ["StartGroups"]

Started = tuple[str, bool]
_Item = tuple[NewInstance, "asyncio.Future[Started]"]


@dataclass(frozen=True)
class _Key:
    """What every start of one group shares: `start_batch` takes it once."""

    pin: Pin
    start_step: str
    actor: str | None


class StartGroups:
    def __init__(self, one: Callable[[NewInstance], Awaitable[Started]],
                 many: Callable[[NewInstances], Awaitable[list[Started]]], *, max_batch: int = 256) -> None:
        self._one = one
        self._many = many
        self.max_batch = max_batch
        self._queues: dict[_Key, list[_Item]] = {}  # a key is here while a start of it is in flight
        self._flushers: dict[_Key, asyncio.Task[None]] = {}

    async def start(self, new: NewInstance) -> Started:
        if not new.plain:
            return await self._one(new)
        key = _Key(new.pin, new.start_step, new.actor)
        queue = self._queues.get(key)
        if queue is not None:  # one is in flight: wait for the next group
            future: asyncio.Future[Started] = asyncio.get_running_loop().create_future()
            queue.append((new, future))
            return await future
        # Nothing in flight: this caller sends its own start, with no task or future in between (a lone
        # start costs what it did before grouping), and hands what queued meanwhile to a flusher.
        self._queues[key] = []
        try:
            return await self._one(new)
        finally:
            if self._queues[key]:
                self._flushers[key] = asyncio.create_task(self._drain(key), name="stepstone-start")
            else:
                del self._queues[key]

    async def _drain(self, key: _Key) -> None:
        batch: list[_Item] = []
        try:
            while queue := self._queues[key]:
                batch, self._queues[key] = queue[: self.max_batch], queue[self.max_batch:]
                await self._flush(key, batch)
        except BaseException:  # the flusher was cancelled (the loop is closing): no caller may hang
            for _, future in batch + self._queues[key]:
                future.cancel()
            raise
        finally:
            del self._flushers[key], self._queues[key]

    async def _flush(self, key: _Key, batch: list[_Item]) -> None:
        if len(batch) == 1:
            await self._flush_one(*batch[0])
            return
        news = [new for new, _ in batch]
        try:
            results = await self._many(NewInstances(
                pin=key.pin, start_step=key.start_step, actor=key.actor, ids=[n.id for n in news],
                states=[n.state for n in news], business_keys=[n.business_key for n in news],
                idempotency_keys=[n.idempotency_key for n in news], fingerprints=[n.fingerprint for n in news]))
        except DatabaseUnavailable as exc:  # as each single start would have failed
            for _, future in batch:
                _settle(future, exc)
            return
        except Exception:  # noqa: BLE001 - one refused item must not sink the others: one by one
            for new, future in batch:
                await self._flush_one(new, future)
            return
        for (_, future), result in zip(batch, results, strict=True):
            _settle(future, result)

    async def _flush_one(self, new: NewInstance, future: asyncio.Future[Started]) -> None:
        try:
            result = await self._one(new)
        except Exception as exc:  # noqa: BLE001 - handed to the caller that started it
            _settle(future, exc)
            return
        _settle(future, result)


def _settle(future: asyncio.Future[Started], outcome: Started | BaseException) -> None:
    if future.done():  # the caller was cancelled; its start may still have happened, as a single one may
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
