"""Who did something: the actor a history entry and a command name.

An actor is stored as text in the `actor` columns: a plain name (the client's `actor="alice"`) or a
JSON object with `kind`, `id`, `reason` and `on_behalf_of`. A worker's commits name the worker and
the actor of the command it ran on behalf of. `Actor.parse` reads both forms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["Actor", "worker_actor"]


@dataclass(frozen=True)
class Actor:
    """Who: `kind` (user, service, worker, system), `id`, an optional `reason`, and whom they acted for."""

    id: str
    kind: str = "user"
    reason: str | None = None
    on_behalf_of: str | None = None

    def encode(self) -> str:
        """The stored text: the bare id for a plain user, JSON otherwise."""
        if self.kind == "user" and self.reason is None and self.on_behalf_of is None and not self.id.startswith("{"):
            return self.id
        body: dict[str, Any] = {"kind": self.kind, "id": self.id}
        if self.reason is not None:
            body["reason"] = self.reason
        if self.on_behalf_of is not None:
            body["on_behalf_of"] = self.on_behalf_of
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def parse(cls, text: str | None) -> Actor | None:
        """The actor a stored text names (None for none)."""
        if text is None or text == "":
            return None
        if text.startswith("{"):
            try:
                body = json.loads(text)
            except ValueError:
                return cls(text)
            if isinstance(body, dict) and isinstance(body.get("id"), str):
                behalf = body.get("on_behalf_of")
                return cls(body["id"], str(body.get("kind") or "user"), body.get("reason"),
                           None if behalf is None else str(behalf))
        return cls(text)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.id, "reason": self.reason, "on_behalf_of": self.on_behalf_of}

    def describe(self) -> str:
        """One line for tables: `worker w1 for alice`, `user bob (ticket 42)`."""
        text = f"{self.kind} {self.id}"
        if self.on_behalf_of:
            behalf = Actor.parse(self.on_behalf_of)
            text += f" for {behalf.id if behalf else self.on_behalf_of}"
        if self.reason:
            text += f" ({self.reason})"
        return text


@lru_cache(maxsize=4096)
def worker_actor(worker: str, on_behalf_of: str | None) -> str:
    """The actor text of a worker's commit: the worker, for whoever recorded the command it ran.
    Cached: every commit asks, and a worker acts for few distinct actors."""
    return Actor(worker, "worker", on_behalf_of=on_behalf_of).encode()
