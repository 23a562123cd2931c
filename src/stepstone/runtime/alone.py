"""Commands a dead worker held run one at a time, alone in their worker, so crashes fall on their cause.

A handler that kills its process (os._exit, a segfault, the OOM killer) takes down every command its
worker held: each one's lease runs out and it is claimed again. Which of the held commands killed the
process cannot be told afterwards; a mark written when every handler starts would cost a round trip a
step. So a command claimed again after a claim that ended without a commit (`claims > 1`: a suspect)
runs alone: the worker gives back (releases, refunding the claim) any other suspect it claimed beside
it, starts nothing more, waits for its other segments to end, marks the claim as run alone (one update,
on suspects only) and runs the suspect with nothing beside it until its first commit. A crash of that
run falls on that command only, and crashes count on a command only by such claims (core/dead_letter.py):
the siblings that merely shared the first crash pay nothing for it, run alone themselves and complete;
the command that kills its process keeps killing it alone and is dead-lettered after `max_claims` of
those (`max_claims` 1 included).
"""

from __future__ import annotations

import asyncio

from stepstone.store.port import Claim


class AloneRuns:
    """The one suspect a worker runs alone (or waits to run alone), if any."""

    def __init__(self) -> None:
        self.claim: Claim | None = None

    @property
    def active(self) -> bool:
        """A suspect waits or runs: the worker claims nothing more until it commits or ends."""
        return self.claim is not None

    def sort(self, claims: list[Claim]) -> tuple[list[Claim], list[Claim]]:
        """The claims to run, and the suspects to give back (all but the first, when none runs yet)."""
        run: list[Claim] = []
        give_back: list[Claim] = []
        for claim in claims:
            if claim.command.claims <= 1:
                run.append(claim)
            elif self.claim is None:
                self.claim = claim
                run.append(claim)
            else:
                give_back.append(claim)
        return run, give_back

    def is_alone(self, claim: Claim) -> bool:
        return self.claim is claim

    def end(self, claim: Claim) -> bool:
        """The suspect committed or its segment ended: others may run beside it. True when it was the one."""
        if self.claim is not claim:
            return False
        self.claim = None
        return True


async def wait_for_the_others(tasks: set[asyncio.Task[None]]) -> None:
    """Until every segment but the current one has ended (none starts meanwhile: `AloneRuns.active`)."""
    me = asyncio.current_task()
    while others := {t for t in tasks if t is not me}:
        await asyncio.wait(others)
