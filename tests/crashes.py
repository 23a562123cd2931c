"""Workers that claim a command and die before they commit, as a killed process does (its lease runs out).

A command claimed again after such a claim runs alone in its worker, which marks that claim
(runtime/alone.py), and a crash counts on a command only by the claims in which it ran alone
(core/dead_letter.py). `die_alone` plays that worker: the first death beside nothing marked (claimed
once, no worker runs a command alone), every later one marked as the worker marks it.
"""

from __future__ import annotations

from datetime import timedelta

from stepstone.store.port import Claim
from stepstone.testing import Engine


async def die_alone(engine: Engine, deaths: int | None = None, *, lease: float = 30.0) -> list[Claim]:
    """`deaths` claims of the one claimable command (by default enough to dead-letter it: its first and
    `max_claims` alone), each left to run out its lease."""
    claims = []
    for _ in range(engine.worker.config.max_claims + 1 if deaths is None else deaths):
        [claim] = await engine.store.claim(1, lease, "a-worker-that-dies")
        if claim.command.claims > 1:
            await engine.store.run_alone(claim.instance.id, claim.instance.position, claim.token)
        claims.append(claim)
        await engine.move_clock(timedelta(seconds=lease + 1))
    return claims
