"""What `stepstone doctor` reads from a database, as named queries from `sql/health.sql`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg
from asyncpg import Record
from asyncpg.pool import PoolConnectionProxy

from stepstone.core.pin import Pin
from stepstone.store.database import translate_errors
from stepstone.store.queries import named_queries

__all__ = [
    "DeferredPin", "clock_offset", "deferred_pins", "role_can_alter_schema", "server_version", "server_version_num",
]


@dataclass(frozen=True)
class DeferredPin:
    """Commands deferred because no worker that claimed them has their pin (kind NOT_RUNNABLE)."""

    pin: Pin
    commands: int
    oldest: datetime
    """When the oldest of them was created."""
    deferrals: int
    """The most times one of them was deferred."""


async def server_version(conn: asyncpg.Connection, schema: str) -> str:
    with translate_errors():
        return str(await conn.fetchval(named_queries("health.sql", schema)["server_version"]))


async def server_version_num(conn: asyncpg.Connection | PoolConnectionProxy[Record], schema: str) -> int:
    """The server's version as a number: 170000 for PostgreSQL 17.0."""
    with translate_errors():
        return int(await conn.fetchval(named_queries("health.sql", schema)["server_version_num"]))


async def clock_offset(conn: asyncpg.Connection, schema: str) -> float:
    """Seconds the database clock is moved from the server's (a test's `advance` left behind): 0 normally."""
    with translate_errors():
        # the store's own test-hook query (queries.sql), read here on doctor's connection
        return float(await conn.fetchval(named_queries("queries.sql", schema)["clock_offset"]))


async def deferred_pins(conn: asyncpg.Connection, schema: str) -> list[DeferredPin]:
    """Every pin with NOT_RUNNABLE deferrals, the one waiting longest first."""
    with translate_errors():
        rows = await conn.fetch(named_queries("health.sql", schema)["deferred_pins"])
    return [
        DeferredPin(Pin(r["scope"], r["definition_id"], r["version"], r["plan_hash"]),
                    int(r["commands"]), r["oldest"], int(r["deferrals"]))
        for r in rows
    ]


async def role_can_alter_schema(conn: asyncpg.Connection, schema: str) -> tuple[str, bool]:
    """(this connection's role, whether it can change the schema: owns it, has CREATE, or is superuser)."""
    with translate_errors():
        row = await conn.fetchrow(named_queries("operations.sql", schema)["role_privileges"], schema)
    if row is None:
        return "", False
    return str(row["role"]), bool(row["superuser"] or row["owns_schema"] or row["can_create"])
