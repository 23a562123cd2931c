"""A database outage for one test: a wrapper over a real store (or one of its ports) whose wrapped calls
fail as an unreachable server's do while `down` (the worker's and the relay's outage logs use it)."""

from __future__ import annotations

import asyncio
from typing import Any

from stepstone.errors import DatabaseUnavailable


class Outage:
    """Delegates to `real`; a subclass routes each call the outage must reach through `check(name)`. `met`
    is set once every name in `watched` has failed `rounds` times; `listeners` keeps the LISTEN connections
    opened through it, which a test closes when it takes the server down."""

    def __init__(self, real: Any, watched: tuple[str, ...], rounds: int = 1) -> None:
        self.real = real
        self.down = False
        self.failed = dict.fromkeys(watched, 0)
        self.rounds = rounds
        self.met = asyncio.Event()
        self.listeners: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def check(self, what: str) -> None:
        if self.down:
            self.failed[what] += 1
            if min(self.failed.values()) >= self.rounds:
                self.met.set()
            raise DatabaseUnavailable("cannot reach PostgreSQL at test: connection refused", host="test", port=None)

    async def listening(self, what: str, listen: Any, *args: Any, **kwargs: Any) -> Any:
        """`listen(*args, **kwargs)` unless down, its listener kept for `take_down`."""
        self.check(what)
        listener = await listen(*args, **kwargs)
        self.listeners.append(listener)
        return listener

    async def take_down(self) -> None:
        self.down = True
        for listener in self.listeners:
            await listener.close()  # the wake-up connection goes with the server
