"""The PostgreSQL adapter of the store port (asyncpg).

Every statement is a named query from `sql/queries.sql`; every driver error is
translated into the stepstone hierarchy here. The hot path is two statements:
`claim` (one round trip per batch) and `commit` (one round trip per step).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from stepstone.core import json_text
from stepstone.core.attribution import worker_actor
from stepstone.core.model import ROOT, Branch, CommandView, InstanceView, Parent
from stepstone.errors import (
    BusinessKeyInUse,
    IdempotencyConflict,
    InstanceNotFound,
    InternalError,
    InvalidState,
    child_not_awaited,
    child_report_pending,
    parent_went_on,
)
from stepstone.store.caller_transaction import CallerTransactionQueries
from stepstone.store.database import create_pool, translate_errors
from stepstone.store.effects import commit_document, event_id
from stepstone.store.kept_connection import KeptConnection
from stepstone.store.observing import ObservingQueries
from stepstone.store.outcomes import signal_command_id
from stepstone.store.port import Claim, CommitRequest, Committed, HeldCommand, NewInstance, NewInstances, Pin, Queued
from stepstone.store.postgres_tasks import TaskQueries, open_signal_limit
from stepstone.store.queries import queries
from stepstone.store.registry import PostgresRegistry
from stepstone.store.scheduling import SchedulingQueries
from stepstone.store.start_groups import StartGroups

log = logging.getLogger("stepstone.store")

STATISTICS_ROWS = 1_000
"""A hot table never analyzed is analyzed by the worker once it holds this many rows (`refresh_statistics`)."""

YOUNG_STATISTICS_TARGET = 10
"""The statistics target of the worker's ANALYZE of a young table (`refresh_statistics`); PostgreSQL's
default is 100 (docs/performance-history.md, "Smaller samples for young tables")."""

STATISTICS_SETTLED = 100_000
"""A hot table last analyzed with this many rows is left to autovacuum, whose re-analysis after a tenth
of it has changed keeps its plans as they are; until then the worker analyzes it whenever it doubles."""

IDEMPOTENCY_CLASH = "SSK01"
"""start_batch: an idempotency key used before with other input (migration 0023)."""

__all__ = ["Listener", "PostgresStore", "event_id"]


async def _init_connection(conn: asyncpg.Connection) -> None:
    for name in ("json", "jsonb"):
        await conn.set_type_codec(
            name, schema="pg_catalog", encoder=json_text.dumps, decoder=json_text.loads, format="text"
        )


async def _reset_connection(conn: asyncpg.Connection) -> None:
    """Skip asyncpg's default reset query on release: a second round trip after every statement.

    The store's pool statements leave no session state (no SET, LISTEN, advisory lock or cursor:
    LISTEN has its own connection, migrations their own). Only a connection given back inside a
    transaction (a statement interrupted mid-way) gets the full reset, which rolls it back.
    """
    if conn.is_in_transaction():
        await conn.reset()


@dataclass
class Listener:
    """A dedicated LISTEN connection (the port's `Listener`); `close` ends it."""

    conn: asyncpg.Connection
    channel: str
    callback: Callable[..., None]

    async def close(self) -> None:
        """End the connection; one the server or the network already cut counts as closed."""
        try:
            await self.conn.remove_listener(self.channel, self.callback)
            await self.conn.close()
        except (OSError, asyncpg.InterfaceError, asyncpg.InternalClientError, asyncpg.PostgresConnectionError) as exc:
            log.debug("wake-up connection already gone (%s)", type(exc).__name__)
        finally:
            if not self.conn.is_closed():
                self.conn.terminate()

    @property
    def alive(self) -> bool:
        return not self.conn.is_closed()


class PostgresStore(SchedulingQueries, CallerTransactionQueries, ObservingQueries, TaskQueries):
    """The store on one asyncpg pool, in one schema (schedules and flow limits: `SchedulingQueries`;
    start and signal on the caller's connection: `CallerTransactionQueries`; health and metrics reads:
    `ObservingQueries`; tasks and messages: `TaskQueries`)."""

    def __init__(self, pool: asyncpg.Pool, url: str, schema: str) -> None:
        self.pool = pool
        self.url = url
        self.schema = schema
        self.q = queries(schema)
        self.channel = f"stepstone_{schema}"
        self._definitions = PostgresRegistry(pool, url, schema)
        self._starts = StartGroups(self._start_one, self.start_many)
        self._kept = KeptConnection(pool)

    @property
    def definitions(self) -> PostgresRegistry:
        """The definitions registry (versions, lifecycle, activations, serving, migration)."""
        return self._definitions

    @classmethod
    async def open(cls, url: str, schema: str = "stepstone", *, max_size: int = 10) -> PostgresStore:
        """A store on a pool of `max_size` connections for concurrent calls, and one more that its
        one-statement calls keep (`stepstone.store.kept_connection`): without it, a pool of one would
        leave a transaction waiting forever behind a connection kept idle."""
        queries(schema)  # validates the schema name before a pool exists that would then leak
        pool = await create_pool(
            url, min_size=1, max_size=max_size + 1, init=_init_connection, reset=_reset_connection
        )
        return cls(pool, url, schema)

    async def close(self) -> None:
        await self._kept.close()
        await self.pool.close()

    async def _fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        with translate_errors(self.url):
            return await self._kept.fetch(self.q[name], *args)

    async def _fetchrow(self, name: str, *args: Any) -> asyncpg.Record | None:
        with translate_errors(self.url):
            return await self._kept.fetchrow(self.q[name], *args)

    async def _one(self, name: str, *args: Any) -> asyncpg.Record:
        """A statement that returns exactly one row (the store's functions do)."""
        row = await self._fetchrow(name, *args)
        if row is None:
            raise InternalError(f"query {name!r} returned no row; the store's functions always return one")
        return row

    async def _fetchval(self, name: str, *args: Any) -> Any:
        with translate_errors(self.url):
            return await self._kept.fetchval(self.q[name], *args)

    # -- the hot path ---------------------------------------------------------------------

    async def claim(self, limit: int, lease_seconds: float, worker: str,
                    definitions: Sequence[str] | None = None) -> list[Claim]:
        """Claim up to `limit` queue heads; only of `definitions` (definition ids) when given."""
        rows = await self._fetch("claim", limit, lease_seconds, worker,
                                 None if definitions is None else list(definitions))
        return [_claim(r) for r in rows]

    async def commit(self, request: CommitRequest, *, lease_seconds: float, worker: str) -> Committed | None:
        """Carry out one decision fenced on the claim's token; None when the token was refused."""
        return (await self._commit_all([request], lease_seconds, worker))[0]

    async def commit_many(
        self, requests: list[CommitRequest], *, lease_seconds: float, worker: str
    ) -> list[Committed | None]:
        """Several segments' commits in one statement and one transaction (group commit).

        Results are in the order of `requests`; each is None when that commit was fenced out.
        Items go to the database in ascending (instance id, position) order, the lock order.
        """
        return await self._commit_all(requests, lease_seconds, worker)

    async def _commit_all(
        self, requests: list[CommitRequest], lease_seconds: float, worker: str
    ) -> list[Committed | None]:
        def key(n: int) -> tuple[str, str]:
            return requests[n].claim.instance.id, requests[n].claim.instance.position

        order = sorted(range(len(requests)), key=key)
        items = [_document(requests[n], lease_seconds, worker) for n in order]
        results: list[Committed | None] = [None] * len(requests)
        for row in await self._fetch("commit_many", items):
            results[order[row["idx"]]] = Committed(
                row["continuation"], row["committed_at"], row["state_version"],
                conflict=row["outcome"] == "conflict", state=row["state"],
            )
        return results

    async def held_command(self, instance_id: str, position: str, token: Any) -> HeldCommand | None:
        """The command this token holds on the position now: re-reads a commit of unknown outcome."""
        row = await self._fetchrow("held_command", uuid.UUID(instance_id), position, token)
        return None if row is None else HeldCommand(int(row["id"]), row["step"], row["visit"])

    async def queued_behind(self, instance_id: str, position: str, command_id: int, limit: int) -> Queued:
        """The ready commands queued right behind this claimed one on its position, in queue order, up to
        `limit` (none past the first that is not ready: `CommandView.behind`), with the instance's state
        and version read in the same snapshot."""
        rows = await self._fetch("queued_behind", uuid.UUID(instance_id), position, command_id, limit)
        if not rows:
            raise InstanceNotFound(instance_id)
        behind = []
        for r in rows:
            if r["id"] is None or not r["ready"]:
                break
            behind.append(CommandView(r["id"], r["kind"], r["step"], r["visit"], r["name"], r["payload"],
                                      r["attempt"], r["claims"], r["last_error"], r["actor"]))
        return Queued(tuple(behind), rows[0]["state"], int(rows[0]["state_version"]))

    async def holds_lease(self, instance_id: str, position: str, token: Any) -> bool:
        return bool(await self._fetchval("holds_lease", _uuid(instance_id), position, token))

    async def settled_by(self, command_id: int, token: Any) -> bool:
        """Whether the claim with this token settled the command (a commit that did happen)."""
        return bool(await self._fetchval("settled_by", command_id, token))

    async def renew(self, held: dict[tuple[str, str], Any], lease_seconds: float) -> set[tuple[str, str]]:
        """Extend the leases of the held positions ((instance id, path) -> token); returns those still held."""
        if not held:
            return set()
        ids = [uuid.UUID(i) for i, _ in held]
        paths = [p for _, p in held]
        rows = await self._fetch("renew", ids, paths, list(held.values()), lease_seconds)
        return {(str(r["instance_id"]), r["path"]) for r in rows}

    async def release(self, instance_id: str, position: str, token: Any) -> bool:
        return bool(await self._fetch("release", uuid.UUID(instance_id), position, token))

    async def defer(self, instance_id: str, position: str, token: Any, reason: str) -> bool:
        return bool(await self._fetch("defer", uuid.UUID(instance_id), position, token, reason))

    async def run_alone(self, instance_id: str, position: str, token: Any) -> int | None:
        """Mark the claim this token holds as run alone; how many earlier claims ran alone without a
        commit, or None when the token no longer holds the lease."""
        value = await self._fetchval("run_alone", uuid.UUID(instance_id), position, token)
        return None if value is None else int(value)

    async def note_error(self, instance_id: str, token: Any, error: str) -> bool:
        """Record a crashed segment's error on the command it holds (shown by its dead letter)."""
        return bool(await self._fetch("note_error", uuid.UUID(instance_id), token, error))

    async def stopped_by(self, instance_id: str, position: str, step: str | None, visit: int | None) -> bool:
        """Whether the failure of this branch's step visit stopped the instance (INSTANCE_FAILED)."""
        return bool(await self._fetchval("stopped_by", uuid.UUID(instance_id), position, step, visit))

    async def next_available(self, served: list[str] | None = None) -> float | None:
        value = await self._fetchval("next_available", served)
        return None if value is None else float(value)

    async def refresh_statistics(self, rows: int = STATISTICS_ROWS, settled: int = STATISTICS_SETTLED) -> bool:
        """ANALYZE the engine's hot tables when one holds `rows` rows or more and was never analyzed, or
        has doubled since it was, while it is young (last analyzed with fewer than `settled` rows); True
        once none is young (there is nothing more to do), or when this role may not analyze them. A role
        that may not ANALYZE them raises InsufficientPrivilege: autovacuum will, within its nap time."""
        row = await self._one("statistics_due", rows, settled)
        if not row["due"]:
            return not row["young"]
        with translate_errors(self.url):
            async with self.pool.acquire() as conn, conn.transaction():
                # One worker at a time: the others find the tables analyzed when they look next (two
                # worker processes analyzed the same four tables at once, 196 ms each, in the bench).
                if not await conn.fetchval(self.q["statistics_lock"], self.schema):
                    return False
                # The names come from the catalog (regclass output, quoted where needed), not from input.
                # A tenth of the default sample: these runs happen while the workflows run, on the cores
                # that commit their steps, and what the young tables' plans need (their size, the few
                # values of a status) a small sample gives; autovacuum re-analyzes a settled table with
                # the server's default. The four tables at 8,000 workflows: 82-132 ms -> 22-33 ms.
                await conn.execute(f"SET LOCAL default_statistics_target = {YOUNG_STATISTICS_TARGET}; "
                                   f"ANALYZE {', '.join(row['due'])}")
        after = await self._one("statistics_due", rows, settled)
        if after["due"]:  # PostgreSQL skips, with a warning, what it may not
            log.info("could not analyze the engine's tables (this role does not own them); autovacuum will")
            return True
        log.info("analyzed %s: %d rows or more, never analyzed or doubled since", ", ".join(row["due"]), rows)
        return not after["young"]

    async def listen(self, callback: Callable[[], None], channel: str | None = None) -> Listener:
        """Open a dedicated wake-up connection on `channel` (default: commands); `callback` runs on every
        notification."""
        with translate_errors(self.url):
            conn = await asyncpg.connect(self.url)

        def on_notify(*_: Any) -> None:
            callback()

        await conn.add_listener(channel or self.channel, on_notify)
        return Listener(conn, channel or self.channel, on_notify)

    async def listen_due(self, callback: Callable[[float, str | None], None]) -> Listener:
        """A LISTEN connection on the commands channel whose `callback` gets, per notification, the
        seconds until the notified command is due on this process's clock (0 or less: now) and the
        command's definition (None when the payload names none).

        The trigger's payload is the command's `available_at` on the server's clock (epoch ms); the
        server's offset from this process's clock is measured once, when the connection opens (half a
        round trip of error). A worker uses it to re-arm its timer for a future command instead of
        claiming: a wait with a timeout inserts such a timer, and the empty claim it would cost an
        idle worker delayed the signal that followed by the worker's wake-up coalescing interval.
        An unreadable payload counts as due now: the payload is a hint, the claim decides. The definition
        follows the time after a colon (migration 0038), so a worker can sleep through the wake-ups of
        workflows it does not serve."""
        with translate_errors(self.url):
            conn = await asyncpg.connect(self.url)
        try:
            with translate_errors(self.url):
                sent = time.time()
                server = float(await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())"))
                offset = server - (sent + time.time()) / 2

            def on_notify(_conn: Any, _pid: int, _channel: str, payload: object) -> None:
                at, _, definition = str(payload).partition(":")
                try:
                    due_in = float(at) / 1000 - offset - time.time()
                except ValueError:
                    due_in = 0.0
                callback(due_in, definition or None)

            with translate_errors(self.url):
                await conn.add_listener(self.channel, on_notify)
        except BaseException:
            await conn.close()
            raise
        return Listener(conn, self.channel, on_notify)

    async def listen_settled(self, callback: Callable[[str], None]) -> Listener:
        """A LISTEN connection on the channel an instance notifies when it completes, fails or is
        cancelled; `callback` gets the instance id."""
        channel = f"stepstone.settled.{self.schema}"[:63]
        with translate_errors(self.url):
            conn = await asyncpg.connect(self.url)

        def on_notify(_conn: Any, _pid: int, _channel: str, payload: object) -> None:
            callback(str(payload))

        try:
            with translate_errors(self.url):
                await conn.add_listener(channel, on_notify)
        except BaseException:
            await conn.close()
            raise
        return Listener(conn, channel, on_notify)

    # -- definitions and instances ------------------------------------------------------------

    async def register(self, pin: Pin, plan: dict[str, Any], **fields: Any) -> None:
        """Record a definition (see `PostgresRegistry.record`; `fields`: `authoring.registration.recorded_fields`,
        else a CODE version); DefinitionDrift when the version is registered with another structure."""
        await self._definitions.record(pin, plan, **fields)

    async def start(self, new: NewInstance) -> tuple[str, bool]:
        """Insert the instance; (id, True) when created, (existing id, False) for a repeated key.
        Concurrent starts of one version share a statement (`stepstone.store.start_groups`)."""
        return await self._starts.start(new)

    async def _start_one(self, new: NewInstance) -> tuple[str, bool]:
        pin = new.pin
        try:
            args = (uuid.UUID(new.id), pin.scope, pin.definition_id, pin.version, pin.plan_hash,
                    new.state, new.start_step, new.business_key, new.idempotency_key, new.fingerprint)
            if new.plain:
                created = await self._fetchval("start", *args, None, new.actor)
            else:  # a durable context kept on the instance (stepstone/context.py), an instance or start deadline
                created = await self._fetchval("start_with", *args, new.actor, new.context, new.deadline_at,
                                               new.deadline_seconds, new.start_deadline_seconds)
        except asyncpg.UniqueViolationError:
            holder = await self._fetchval("business_key_holder", pin.scope, pin.definition_id, new.business_key)
            raise BusinessKeyInUse(new.business_key or "", str(holder)) from None
        if created is not None:
            return str(created), True
        row = await self._one("start_key", f"{pin.scope}/{pin.definition_id}", new.idempotency_key)
        if row["fingerprint"] != new.fingerprint:
            raise IdempotencyConflict(
                f"idempotency key {new.idempotency_key!r} already started instance {row['target']} "
                "with different input",
                instance_id=row["target"],
            )
        return row["target"], False

    async def start_many(self, new: NewInstances) -> list[tuple[str, bool]]:
        """Insert many instances of one version in one statement and one transaction: all or none.
        Per item, in order: (id, True) when created, (the key's earlier instance, False) for a repeated
        idempotency key with the same input."""
        pin = new.pin
        try:
            rows = await self._fetch(
                "start_batch", [uuid.UUID(i) for i in new.ids], pin.scope, pin.definition_id, pin.version,
                pin.plan_hash, list(new.states), new.start_step, list(new.business_keys), list(new.idempotency_keys),
                list(new.fingerprints), new.actor, new.context, new.deadline_at, new.deadline_seconds,
                new.start_deadline_seconds)
        except asyncpg.UniqueViolationError:
            held = await self._fetchrow("business_keys_held", pin.scope, pin.definition_id,
                                        [k for k in new.business_keys if k is not None])
            if held is None:  # taken by a start that rolled back since: the batch may simply be retried
                raise BusinessKeyInUse("(one of the batch's business keys)", "") from None
            raise BusinessKeyInUse(held["business_key"], str(held["id"])) from None
        except asyncpg.PostgresError as exc:
            if exc.sqlstate != IDEMPOTENCY_CLASH:
                raise
            raise IdempotencyConflict(exc.args[0] if exc.args else str(exc),
                                      instance_id=str(getattr(exc, "detail", "") or "")) from None
        return [(str(r["instance_id"]), bool(r["created"])) for r in rows]

    async def signal(
        self, instance_id: str, name: str, payload: Any, *, dedup_key: str | None, fingerprint: str, actor: str | None,
        position: str = "", context: Any = None,
    ) -> int:
        with open_signal_limit(instance_id):
            if context is None:
                row = await self._one("signal", _uuid(instance_id), position, name, payload, dedup_key, fingerprint,
                                      actor)
            else:
                row = await self._one("signal_with_context", _uuid(instance_id), position, name, payload, dedup_key,
                                      fingerprint, actor, context)
        return signal_command_id(dict(row), instance_id, name, dedup_key, position)

    async def cancel(self, instance_id: str, reason: str, actor: str | None) -> str:
        return (await self.cancel_saga(instance_id, reason, actor, compensate=False))[1]

    async def cancel_saga(
        self, instance_id: str, reason: str, actor: str | None, *, compensate: bool
    ) -> tuple[str, str]:
        """(outcome, status): outcome cancelled, compensating, or unchanged (it had already ended)."""
        row = await self._one("cancel", _uuid(instance_id), reason, actor, compensate)
        if row["outcome"] == "not_found":
            raise InstanceNotFound(instance_id)
        return str(row["outcome"]), str(row["status"])

    async def compensations(self, instance_id: str) -> list[dict[str, Any]]:
        await self.status(instance_id)
        return [dict(r) for r in await self._fetch("compensations", _uuid(instance_id))]

    async def retry(self, instance_id: str, actor: str | None) -> None:
        row = await self._one("retry", _uuid(instance_id), actor)
        if row["outcome"] == "not_found":
            raise InstanceNotFound(instance_id)
        if row["outcome"] == "parent_went_on":
            raise parent_went_on(instance_id, str(row["parent_id"]), row["parent_status"] or "deleted")
        if row["outcome"] == "report_pending":
            raise child_report_pending(instance_id, str(row["parent_id"]), row["parent_status"])
        if row["outcome"] == "not_awaited":  # what it says of the parent: read after the refusal
            parent = await self._fetchrow("parent_of_child", _uuid(instance_id))
            raise child_not_awaited(instance_id, dict(parent) if parent is not None else {})
        if row["outcome"] == "not_failed":
            raise InvalidState(
                f"instance {instance_id} is {row['status']}; only a FAILED or COMPENSATION_FAILED instance can be "
                "retried",
                instance_id=instance_id,
                status=row["status"],
            )

    async def get(self, instance_id: str) -> dict[str, Any]:
        row = await self._fetchrow("get_instance", _uuid(instance_id))
        if row is None:
            raise InstanceNotFound(instance_id)
        return {**dict(row), "id": str(row["id"])}

    async def status(self, instance_id: str) -> str:
        value = await self._fetchval("instance_status", _uuid(instance_id))
        if value is None:
            raise InstanceNotFound(instance_id)
        return str(value)

    async def history(self, instance_id: str) -> list[dict[str, Any]]:
        await self.status(instance_id)
        return [dict(r) for r in await self._fetch("history", _uuid(instance_id))]

    async def list(
        self,
        *,
        status: str | None = None,
        definition: str | None = None,
        business_key: str | None = None,
        after: tuple[datetime, str] | None = None,
        limit: int = 50,
        scope: str | None = None,
        include_archived: bool = False,
    ) -> list[dict[str, Any]]:
        at, after_id = after if after else (None, None)
        rows = await self._fetch(
            "list_instances", status, definition, business_key, at, _uuid(after_id) if after_id else None, limit,
            scope, include_archived,
        )
        return [{**dict(r), "id": str(r["id"])} for r in rows]

    async def db_now(self) -> datetime:
        value: datetime = await self._fetchval("db_now")
        return value

    async def move_clock(self, seconds: float) -> datetime:
        """Test hook: move the database clock forward (or back) for every session."""
        value: datetime = await self._fetchval("move_clock", seconds)
        return value

    async def clock_offset(self) -> float:
        """Test hook: seconds the database clock is moved from the server's."""
        return float(await self._fetchval("clock_offset"))

    async def set_clock_offset(self, seconds: float) -> datetime:
        """Test hook: set the database clock's offset (e.g. back to what it was); returns the new time."""
        value: datetime = await self._fetchval("set_clock_offset", seconds)
        return value


def _uuid(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise InstanceNotFound(str(value)) from None


def _claim(r: asyncpg.Record) -> Claim:
    parent = None
    if r["parent_id"] is not None:
        parent = Parent(str(r["parent_id"]), r["parent_position"] or ROOT, r["parent_visit"] or 0)
    branch = None
    if r["branch_parent"] is not None:
        branch = Branch(r["branch_parent"], r["branch_visit"], r["branch_name"], r["branch_item"])
    instance = InstanceView(
        str(r["instance_id"]), r["status"], r["step"], r["visit"], r["state"], r["wait"],
        position=r["position"], position_status=r["position_status"], state_version=r["state_version"],
        parent=parent, branch=branch,
    )
    command = CommandView(
        r["command_id"], r["kind"], r["command_step"], r["command_visit"], r["name"], r["payload"],
        r["attempt"], r["claims"], r["last_error"], r["actor"],
    )
    pin = Pin(r["scope"], r["definition_id"], r["version"], r["plan_hash"])
    return Claim(instance, command, pin, r["token"], r["now"], r["business_key"], r["context"],
                 r["instance_created_at"])


def _document(request: CommitRequest, lease_seconds: float, worker: str) -> dict[str, Any]:
    instance = request.claim.instance
    return commit_document(
        request.decision, instance_id=instance.id, position=instance.position, command_id=request.command_id,
        token=request.claim.token, visit=request.visit, state_version=request.state_version,
        version=request.claim.pin.version, lease_seconds=lease_seconds, worker=worker,
        actor=worker_actor(worker, request.claim.command.actor),
    )
