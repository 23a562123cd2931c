"""Two group commits made to cross: [a, b] and [c, d], with b's and d's instance rows held elsewhere until
each group has taken its first item, so that whatever a group takes with its first item it holds while it
waits for its second's row."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from stepstone import client_starts
from stepstone.ids import new_instance_id
from stepstone.runtime.committer import GroupCommitter
from stepstone.store.port import CommitRequest, Committed, WorkerStore
from tests._pg import until_blocked


def ids_in_start_order(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """The next `count` starts get ids that ascend in start order. A group's items go in id order, and ids
    made in one millisecond are ordered by their random bits, so starts that close together can come out of
    the id order the crossed groups are built on."""
    ascending = iter(sorted(new_instance_id() for _ in range(count)))
    monkeypatch.setattr(client_starts, "new_instance_id", ascending.__next__)


async def commit_crossed(store: WorkerStore, database_url: str, conn: asyncpg.Connection,
                         requests: tuple[CommitRequest, CommitRequest, CommitRequest, CommitRequest],
                         ) -> list[Committed | None]:
    """Commit [a, b] and [c, d] as two groups at once, b's and d's rows held until both groups wait."""
    a, b, c, d = requests
    holder = await asyncpg.connect(database_url)
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute("SELECT 1 FROM stepstone.instances WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE",
                             [b.claim.instance.id, d.claim.instance.id])
        groups = [GroupCommitter(store, lease_seconds=30, worker="grouper") for _ in range(2)]
        both = asyncio.gather(*(groups[0].commit(r) for r in (a, b)), *(groups[1].commit(r) for r in (c, d)))
        await until_blocked(conn, holder, 2, every=0.02, timeout=10,
                            failure="the two groups never came to wait for the held rows")
        await held.commit()
        return await asyncio.wait_for(both, timeout=30)
    finally:
        await holder.close()
