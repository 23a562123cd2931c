"""What `stepstone doctor` reads from the definitions registry: the stranded-instance report."""

from __future__ import annotations

from typing import Any

import asyncpg

from stepstone.store.database import translate_errors
from stepstone.store.queries import named_queries

__all__ = ["STRANDED_WITHIN_SECONDS", "stranded_pins"]

STRANDED_WITHIN_SECONDS = 300.0


async def stranded_pins(
    conn: asyncpg.Connection, schema: str, within_seconds: float = STRANDED_WITHIN_SECONDS
) -> list[dict[str, Any]]:
    """Pins of instances that may still run which no worker served within `within_seconds`."""
    with translate_errors():
        rows = await conn.fetch(named_queries("registry.sql", schema)["stranded"], within_seconds, None)
    return [
        {"scope": r["scope"], "definition_id": r["definition_id"], "version": r["version"],
         "plan_hash": r["plan_hash"], "instances": int(r["instances"]),
         "deferred_commands": int(r["deferred_commands"]), "within_minutes": within_seconds / 60}
        for r in rows
    ]
