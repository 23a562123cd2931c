"""Messages published while the waits of their key open and close under them (a skip signal, a timeout, a
cancel, an instance that ends) and while workers die or pause holding claims, against real PostgreSQL: no
message is lost, none is taken twice.

Each round publishes 40 messages of one key, each once or twice (its message id), with a ttl, without one, or
to every wait (`correlate_all`), while six instances (and more started meanwhile) loop at a wait of that key
and a disturber signals, moves the clock past the waits' timeouts, cancels, and claims commands for a worker
that dies (its lease runs out) or pauses (it commits what it decided later, perhaps fenced). Then every
message was taken by one wait (its MESSAGE command applied), or is buffered (with a ttl) or dropped (without),
and a copy to every wait was taken at most once by each.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections import Counter
from typing import Any

import asyncpg

from stepstone.authoring.workflow import END, Registry, StepContext, Workflow
from stepstone.core.model import Decision
from stepstone.core.transitions import apply
from stepstone.errors import InvalidState
from stepstone.store.port import Claim, CommitRequest
from stepstone.testing import Engine, open_engine

churn = Workflow("churn", version=1)
PUBLISHED = 40


@churn.step(start=True, next="await_m")
async def begin(ctx: StepContext, state: dict[str, Any]) -> None:
    state["got"] = []


churn.wait("await_m", messages={"m": "took"}, signals={"skip": "took"}, correlation="k", timeout=60,
           on_timeout="timed")


@churn.step(next=["await_m", END])
async def took(ctx: StepContext, state: dict[str, Any]) -> str:
    assert ctx.signal is not None
    state["got"].append([ctx.signal.name, (ctx.signal.payload or {}).get("n")])
    return "await_m" if len(state["got"]) < state.get("rounds", 10**6) else END


@churn.step(next="await_m")
async def timed(ctx: StepContext, state: dict[str, Any]) -> None:
    state["got"].append(["timeout", None])


class Round:
    """One key's messages, its instances and the disturbances, all drawn from `seed`."""

    def __init__(self, engine: Engine, seed: int) -> None:
        self.engine, self.c, self.seed = engine, engine.client, seed
        self.rng = random.Random(seed)  # noqa: S311 - a reproducible workload and disturbance schedule
        self.key = f"k{seed}"
        self.ids: list[str] = []
        self.every: set[int] = set()  # published to every wait
        self.dropping: set[int] = set()  # published without a ttl
        self.zombies: list[tuple[Claim, Decision]] = []
        self.done = asyncio.Event()
        self.cancelled = 0

    async def start(self, rounds: int | None) -> None:
        self.ids.append(await self.c.start(churn, {"k": self.key} | ({} if rounds is None else {"rounds": rounds})))

    async def publisher(self) -> None:
        for n in range(PUBLISHED):
            kind, mid = self.rng.random(), f"{self.seed}/{n}"
            if kind < 0.15:
                self.every.add(n)
                await self.c.publish_message("m", self.key, {"n": n}, message_id=mid, correlate_all=True)
                continue
            ttl = None if kind < 0.35 else 10 * 86400
            if ttl is None:
                self.dropping.add(n)
            for _ in range(2 if self.rng.random() < 0.2 else 1):  # a repeat is a duplicate
                await self.c.publish_message("m", self.key, {"n": n}, message_id=mid, ttl=ttl)
            await asyncio.sleep(0)  # let the others interleave; nothing waited for
        self.done.set()

    async def disturber(self) -> None:
        while not self.done.is_set():
            r = self.rng.random()
            if r < 0.4:
                with contextlib.suppress(InvalidState):  # ended meanwhile
                    await self.c.signal(self.rng.choice(self.ids[self.cancelled:]), "skip", {"n": -1})
            elif r < 0.55:
                await self.engine.move_clock(61)  # past the waits' timeouts
            elif r < 0.65:
                await self.die_or_pause()
            elif r < 0.7:
                await self.wake()
            elif r < 0.78:
                await self.start(self.rng.randint(1, 4))
            elif r < 0.8 and self.cancelled < 2:
                with contextlib.suppress(InvalidState):
                    await self.c.cancel(self.ids[self.cancelled], reason="churn")
                self.cancelled += 1
            await asyncio.sleep(0)

    async def die_or_pause(self) -> None:
        """A worker claims what is claimable and dies (its lease runs out), or pauses: what it decided without a
        handler is committed later, by `wake`, after others may have taken the command over."""
        for claim in await self.engine.store.claim(self.rng.randint(1, 3), 30, "dies"):
            decision = apply(claim.instance, claim.command, churn.plan, claim.now)
            if self.rng.random() < 0.5 and isinstance(decision, Decision):
                self.zombies.append((claim, decision))

    async def wake(self) -> None:
        while self.zombies:
            claim, decision = self.zombies.pop()
            await self.engine.store.commit(CommitRequest(claim, claim.command.id, decision, claim.instance.visit,
                                                         claim.instance.state_version), lease_seconds=30, worker="dies")


async def _run(engine: Engine, seed: int) -> Round:
    r = Round(engine, seed)
    for _ in range(5):
        await r.start(r.rng.randint(1, 4))
    await r.start(None)  # one that never ends
    await engine.run_until_idle()
    other = engine.new_worker(concurrency=4, lease_seconds=30)

    async def work(worker: Any) -> None:
        while not r.done.is_set():
            await worker.run_until_idle()
            await asyncio.sleep(0)

    await asyncio.gather(r.publisher(), r.disturber(), work(engine.worker), work(other))
    await r.wake()
    for _ in range(3):
        await engine.move_clock(31)  # the dead workers' leases run out
        await engine.run_until_idle()
        await other.run_until_idle()
    return r


async def _check(r: Round, conn: asyncpg.Connection) -> None:
    # Taken: a wait applied its MESSAGE command (COMPLETE). The step it leads to may be cancelled with its
    # instance before its handler commits, so the state alone need not show it.
    taken: Counter[Any] = Counter()
    for row in await conn.fetch("SELECT payload->>'message_id' AS m, instance_id FROM stepstone.commands "
                                "WHERE kind = 'MESSAGE' AND state = 'COMPLETE' AND payload->>'message_id' LIKE $1",
                                f"{r.seed}/%"):
        n = int(row["m"].split("/")[1])
        taken[(n, row["instance_id"]) if n in r.every else n] += 1
    for iid in r.ids:
        seen = [n for name, n in (await r.c.get(iid)).state.get("got", []) if name == "m"]
        assert all(taken[(n, uuid.UUID(iid)) if n in r.every else n] for n in seen), (r.seed, iid, seen)
    status = {int(row["message_id"].split("/")[1]): row["status"] for row in await conn.fetch(
        "SELECT status, message_id FROM stepstone.messages WHERE message_id LIKE $1", f"{r.seed}/%")}
    assert {n: k for n, k in taken.items() if k > 1} == {}, r.seed  # none taken twice
    lost = {n: status.get(n) for n in range(PUBLISHED) if n not in r.every and n not in taken
            and status.get(n) != ("DROPPED" if n in r.dropping else "BUFFERED")}
    assert lost == {}, r.seed
    open_waits = await conn.fetchval(
        "SELECT count(*) FROM stepstone.subscriptions x JOIN stepstone.positions p ON p.instance_id = x.instance_id "
        "AND p.path = x.position AND p.visit = x.visit AND p.status = 'WAITING' "
        "WHERE x.status = 'OPEN' AND x.correlation_key = $1", r.key)
    assert not (open_waits and "BUFFERED" in status.values()), r.seed  # a buffered one went to an open wait
    left = await conn.fetch(  # none left behind: pending, or parked though it should go on
        "SELECT id, state FROM stepstone.commands WHERE kind = 'MESSAGE' AND payload->>'message_id' LIKE $1 "
        "AND state NOT IN ('COMPLETE', 'STALE', 'REJECTED', 'CANCELLED') "
        "AND NOT (state = 'PARKED' AND NOT payload ?| ARRAY['goes_on', 'buffered'])", f"{r.seed}/%")
    assert left == [], r.seed


async def test_messages_under_churn_are_taken_once(database_url: str, conn: asyncpg.Connection) -> None:
    async with open_engine(database_url, Registry(churn), concurrency=4, lease_seconds=30, max_claims=50) as engine:
        for seed in range(3):
            await _check(await _run(engine, seed), conn)
