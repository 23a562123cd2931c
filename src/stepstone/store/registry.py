"""The definitions registry on PostgreSQL: versions, their lifecycle, activations, what workers serve.

    record            a worker's (or client's) code definition, or a document's row: inserted once;
                      the same (scope, id, version) with another plan hash is drift, refused
    transition        AVAILABLE -> DEPRECATED, DEPRECATED -> AVAILABLE, RETIRED -> AVAILABLE (reinstate,
                      with the caller's plan hash checked), CANDIDATE|DEPRECATED -> RETIRED (no live pins)
    publish           CANDIDATE -> PUBLISHING (claim token) -> AVAILABLE (fenced on the token)
    activate          a scope's current version (the target must be AVAILABLE), with the schedules whose
                      stored input it refuses (store.activation_inputs)
    select_version    what a start in a scope selects; pin admission (the instances trigger) is the fence
    heartbeat         which pins a worker serves; `stranded` reports instances nobody serves
    migrate_instance  one fenced in-flight migration, in the instance's command order (migrations 0008, 0017)

Every lifecycle change is one READ COMMITTED transaction that takes the definition id's advisory lock
first, then the id's rows in order, so changes of one id serialize and never deadlock.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

from stepstone.core.model import MAY_RUN
from stepstone.core.pin import DEFAULT_SCOPE, Pin
from stepstone.errors import (
    DefinitionDrift,
    DefinitionNotFound,
    DocumentTampered,
    InstanceNotFound,
    InvalidTransition,
)
from stepstone.store.activation_inputs import inputs_refused
from stepstone.store.database import translate_errors
from stepstone.store.queries import named_queries
from stepstone.store.registry_port import SERVED_WITHIN_SECONDS, DefinitionRecord, RefusedInput, StrandedPin

__all__ = ["PostgresRegistry", "digest_of"]

STATUSES = ("CANDIDATE", "PUBLISHING", "AVAILABLE", "DEPRECATED", "RETIRED")
_TRANSITIONS = {("AVAILABLE", "DEPRECATED"), ("DEPRECATED", "AVAILABLE"), ("RETIRED", "AVAILABLE")}
PUBLICATION_CLAIM_SECONDS = 60.0


def digest_of(text: str) -> str:
    """The lowercase hex SHA-256 of a document's UTF-8 text, as stored beside it."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class PostgresRegistry:
    """The registry's statements on the store's pool (`PostgresStore.definitions`)."""

    def __init__(self, pool: asyncpg.Pool, url: str, schema: str) -> None:
        self.pool = pool
        self.url = url
        self.q = named_queries("registry.sql", schema)

    # -- recording ----------------------------------------------------------------------------

    async def record(
        self, pin: Pin, plan: dict[str, Any], *, kind: str = "CODE", status: str = "AVAILABLE",
        state_model: str | None = None, input_schema: Any = None, document: str | None = None,
        document_format: str | None = None,
    ) -> str:
        """Record a version; 'inserted', 'unchanged', or 'attached' when a document's text joins the same
        version registered without it (from code). The same version with another plan hash (or, for a
        document, other text) raises DefinitionDrift and writes nothing."""
        signals = sorted(plan.get("signals", []))
        messages = sorted({m for step in plan.get("steps", []) for m in step.get("messages") or {}})
        digest = digest_of(document) if document is not None else None
        with translate_errors(self.url):
            async with self.pool.acquire() as conn, conn.transaction(isolation="read_committed"):
                await conn.execute(self.q["lock_definition"], pin.definition_id)
                inserted = await conn.fetchval(
                    self.q["insert_definition"], pin.scope, pin.definition_id, pin.version, pin.plan_hash, plan,
                    kind, status, state_model, signals, messages, input_schema, document,
                    document_format, digest,
                )
                if inserted is not None:
                    if pin.scope == DEFAULT_SCOPE and status == "AVAILABLE":
                        await conn.execute(self.q["activate_first"], pin.definition_id, pin.version)
                    return "inserted"
                row = await conn.fetchrow(self.q["definition_row"], pin.scope, pin.definition_id, pin.version)
                assert row is not None
                if row["plan_hash"] != pin.plan_hash:
                    given = "this document" if kind == "DOCUMENT" else "this code"
                    raise DefinitionDrift(
                        f"drift: workflow {pin.definition_id!r} v{pin.version} (scope {pin.scope}) is registered "
                        f"with plan {row['plan_hash'][:12]} but {given} has plan {pin.plan_hash[:12]}; its "
                        "structure changed without a version bump: give it a new version (nothing was re-pinned)",
                        definition_id=pin.definition_id, version=pin.version,
                    )
                if digest is not None and row["document_digest"] not in (None, digest):
                    raise DefinitionDrift(
                        f"drift: document {pin.definition_id!r} v{pin.version} (scope {pin.scope}) is stored with "
                        "other text under the same plan; publish the change as a new version",
                        definition_id=pin.definition_id, version=pin.version,
                    )
                if digest is not None and row["document_digest"] is None:
                    await conn.execute(self.q["attach_document"], pin.scope, pin.definition_id, pin.version,
                                       document, document_format, digest)
                    return "attached"
                if kind == "CODE":
                    await conn.execute(self.q["fill_code_metadata"], pin.scope, pin.definition_id, pin.version,
                                       state_model, signals, input_schema, plan.get("sensitive_payloads"))
                return "unchanged"

    # -- lifecycle ----------------------------------------------------------------------------

    async def find(self, scope: str, definition_id: str, version: int) -> dict[str, Any]:
        row = await self._fetchrow("definition_row", scope, definition_id, version)
        if row is None:
            raise DefinitionNotFound(definition_id, version)
        return dict(row)

    async def transition(
        self, scope: str, definition_id: str, version: int, to: str, *, plan_hash: str | None = None
    ) -> str:
        """Move a version's status (see the module docstring); returns the status before."""
        with translate_errors(self.url):
            async with self.pool.acquire() as conn, conn.transaction(isolation="read_committed"):
                await conn.execute(self.q["lock_definition"], definition_id)
                await conn.fetch(self.q["lock_rows"], definition_id)
                row = await conn.fetchrow(self.q["definition_row"], scope, definition_id, version)
                if row is None:
                    raise DefinitionNotFound(definition_id, version)
                before = str(row["status"])
                where = f"workflow {definition_id!r} v{version} (scope {scope})"
                # Checked first: code that is not this version is drift even where nothing would change
                # (a reinstate of an AVAILABLE version said "already AVAILABLE" to drifted code).
                if to == "AVAILABLE" and plan_hash is not None and plan_hash != row["plan_hash"]:
                    raise DefinitionDrift(
                        f"drift: {where} was registered with plan {row['plan_hash'][:12]}; the code at hand has "
                        f"plan {plan_hash[:12]}: " + ("it cannot be reinstated as that version" if before != to else
                        "it is AVAILABLE, but that code is not this version (a worker with it refuses to start); "
                        "give the code a new version"),
                        definition_id=definition_id, version=version,
                    )
                if before == to:
                    return before
                if to == "RETIRED":
                    await self._check_retire(conn, row, where)
                elif (before, to) not in _TRANSITIONS:
                    raise InvalidTransition(f"{where} is {before}; it cannot become {to}",
                                            definition_id=definition_id, version=version)
                if to in ("DEPRECATED", "RETIRED"):
                    await self._check_not_current(conn, scope, definition_id, version, where)
                await conn.fetchval(self.q["set_status"], scope, definition_id, version, to, None)
                return before

    async def _check_retire(self, conn: Any, row: asyncpg.Record, where: str) -> None:
        if row["status"] not in ("CANDIDATE", "DEPRECATED"):
            raise InvalidTransition(f"{where} is {row['status']}; deprecate it before retiring it",
                                    definition_id=row["definition_id"], version=row["version"])
        if row["status"] == "DEPRECATED":
            live = int(await conn.fetchval(self.q["live_pins"], row["scope"], row["definition_id"], row["version"],
                                           list(MAY_RUN)))
            if live:
                raise InvalidTransition(
                    f"{where} still pins {live} instance(s) that may run; let them finish or migrate them first",
                    definition_id=row["definition_id"], version=row["version"],
                )

    async def _check_not_current(
        self, conn: Any, scope: str, definition_id: str, version: int, where: str
    ) -> None:
        rows = await conn.fetch(self.q["activations"], None, definition_id)
        naming = sorted(r["scope"] for r in rows if r["target_scope"] == scope and r["version"] == version)
        if naming:
            raise InvalidTransition(
                f"{where} is the current version of scope(s) {', '.join(naming)}; activate another version first",
                definition_id=definition_id, version=version,
            )

    async def publish(self, pin: Pin) -> str:
        """CANDIDATE -> PUBLISHING -> AVAILABLE; returns the status after. An AVAILABLE row is left as is."""
        token = await self.claim_publication(pin)
        if token is None:
            return str((await self.find(pin.scope, pin.definition_id, pin.version))["status"])
        await self.complete_publication(pin, token)
        return "AVAILABLE"

    async def claim_publication(self, pin: Pin) -> uuid.UUID | None:
        """CANDIDATE (or a PUBLISHING claim at least PUBLICATION_CLAIM_SECONDS old) -> PUBLISHING with a fresh
        token; None when the row is already AVAILABLE or DEPRECATED; InvalidTransition otherwise."""
        token = uuid.uuid4()
        with translate_errors(self.url):
            async with self.pool.acquire() as conn, conn.transaction(isolation="read_committed"):
                await conn.execute(self.q["lock_definition"], pin.definition_id)
                claimed = await conn.fetchval(self.q["claim_publication"], pin.scope, pin.definition_id,
                                              pin.version, token, PUBLICATION_CLAIM_SECONDS)
        if claimed is not None:
            return token
        row = await self.find(pin.scope, pin.definition_id, pin.version)
        if row["status"] in ("AVAILABLE", "DEPRECATED"):
            return None
        raise InvalidTransition(
            f"workflow {pin.definition_id!r} v{pin.version} (scope {pin.scope}) is {row['status']}; only a "
            "CANDIDATE (or a stale publication) can be published", definition_id=pin.definition_id,
            version=pin.version,
        )

    async def complete_publication(self, pin: Pin, token: uuid.UUID) -> None:
        """PUBLISHING -> AVAILABLE for the claim holding `token`; an obsolete claim raises InvalidTransition."""
        with translate_errors(self.url):
            async with self.pool.acquire() as conn, conn.transaction(isolation="read_committed"):
                await conn.execute(self.q["lock_definition"], pin.definition_id)
                done = await conn.fetchval(self.q["complete_publication"], pin.scope, pin.definition_id,
                                           pin.version, token)
                if done is not None and pin.scope == DEFAULT_SCOPE:
                    await conn.execute(self.q["activate_first"], pin.definition_id, pin.version)
        if done is None:
            raise InvalidTransition(
                f"publication of {pin.definition_id!r} v{pin.version} was taken over by another publisher",
                definition_id=pin.definition_id, version=pin.version,
            )

    async def activate(
        self, scope: str, definition_id: str, version: int, *, target_scope: str | None = None,
        actor: str | None = None,
    ) -> list[RefusedInput]:
        """Make `version` (of `target_scope`: the scope itself or default) the scope's current version, and
        return the schedules whose ticks start it from now on and whose stored input its input schema refuses
        (each tick of them will be skipped): read in the same transaction. They do not refuse the activation;
        `stepstone.ops.definitions.activate` also logs them."""
        target = target_scope or scope
        if target not in (scope, DEFAULT_SCOPE):
            raise InvalidTransition(f"scope {scope} can only follow its own rows or the default scope's, not {target}",
                                    definition_id=definition_id, version=version)
        with translate_errors(self.url):
            async with self.pool.acquire() as conn, conn.transaction(isolation="read_committed"):
                await conn.execute(self.q["lock_definition"], definition_id)
                await conn.fetch(self.q["lock_rows"], definition_id)
                row = await conn.fetchrow(self.q["definition_row"], target, definition_id, version)
                if row is None or row["status"] != "AVAILABLE":
                    status = "not registered" if row is None else row["status"]
                    raise InvalidTransition(
                        f"cannot activate workflow {definition_id!r} v{version} of scope {target} for scope {scope}: "
                        f"it is {status} (only an AVAILABLE version can be activated)",
                        definition_id=definition_id, version=version,
                    )
                await conn.execute(self.q["put_activation"], scope, definition_id, target, version, actor)
                return await self._refused(conn, definition_id, version)

    async def deactivate(self, scope: str, definition_id: str) -> list[RefusedInput]:
        """Remove the scope's activation: it follows the default scope again. Returns, as `activate` does, the
        scope's schedules whose stored input the version it now selects refuses, read in the same transaction."""
        with translate_errors(self.url):
            async with self.pool.acquire() as conn, conn.transaction(isolation="read_committed"):
                await conn.execute(self.q["lock_definition"], definition_id)
                await conn.execute(self.q["remove_activation"], scope, definition_id)
                selected = await _OnConnection(conn, self.q).select_version(scope, definition_id)
                return [] if selected is None else await self._refused(conn, definition_id, selected[1], scope)

    async def _refused(self, conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy, definition_id: str,
                       version: int, scope: str | None = None) -> list[RefusedInput]:
        """The schedules of `definition_id` (of `scope` alone when given) whose ticks start `version` and whose
        stored input it refuses, read on `conn` (the write's transaction)."""
        schedules = [dict(r) for r in await conn.fetch(self.q["definition_schedules"], definition_id)
                     if scope is None or r["scope"] == scope]
        return await inputs_refused(schedules, _OnConnection(conn, self.q), definition_id, version)

    async def activations(self, scope: str | None = None, definition_id: str | None = None) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._fetch("activations", scope, definition_id)]

    async def select_version(self, scope: str, definition_id: str) -> tuple[str, int, str] | None:
        """(definition scope, version, plan hash) a start in `scope` selects, or None when nothing is recorded."""
        row = await self._fetchrow("select_version", scope, definition_id)
        return None if row is None else (str(row["target_scope"]), int(row["version"]), str(row["plan_hash"]))

    async def child_pin(self, child_id: str, definition_id: str) -> tuple[int, str] | None:
        """(version, plan hash) of child `child_id` when it exists already, else None."""
        row = await self._fetchrow("child_pin", uuid.UUID(child_id), definition_id)
        return None if row is None else (int(row["version"]), str(row["plan_hash"]))

    async def records(
        self, *, scope: str | None = None, definition_id: str | None = None, status: str | None = None
    ) -> list[DefinitionRecord]:
        rows = await self._fetch("list_definitions", scope, definition_id, status)
        return [
            DefinitionRecord(r["scope"], r["definition_id"], r["version"], r["kind"], r["status"], r["plan_hash"],
                             r["state_model"], list(r["signal_names"] or []), r["registered_at"], r["active"],
                             r["document_digest"])
            for r in rows
        ]

    async def document(self, scope: str, definition_id: str, version: int) -> tuple[str, str]:
        """(text, format) of a DOCUMENT row, its SHA-256 digest checked; DocumentTampered otherwise. No size
        limit: the text passed the one it was published under, and the digest says it is that text."""
        row = await self._fetchrow("document_text", scope, definition_id, version)
        if row is None or row["kind"] != "DOCUMENT":
            raise DefinitionNotFound(definition_id, version)
        where = f"document {definition_id!r} v{version} (scope {scope})"
        text = str(row["document"])
        if digest_of(text) != row["document_digest"]:
            raise DocumentTampered(f"{where}: the stored text no longer matches its SHA-256 digest; not used")
        return text, str(row["document_format"])

    # -- serving --------------------------------------------------------------------------------

    async def heartbeat(self, worker_id: str, pins: list[Pin]) -> None:
        await self._fetch("heartbeat", worker_id, [p.scope for p in pins], [p.definition_id for p in pins],
                          [p.version for p in pins], [p.plan_hash for p in pins])

    async def resume_deferred(self, pins: list[Pin]) -> int:
        """Deferred commands of these pins become claimable now; returns how many."""
        rows = await self._fetch("resume_deferred", [p.definition_id for p in pins], [p.version for p in pins],
                                 [p.plan_hash for p in pins])
        return len(rows)

    async def forget_worker(self, worker_id: str) -> None:
        await self._fetch("forget_worker", worker_id)

    async def stranded(self, within_seconds: float, scope: str | None = None, *,
                       scopes: Sequence[str] | None = None) -> list[StrandedPin]:
        within = [scope] if scope is not None else None if scopes is None else list(scopes)
        rows = await self._fetch("stranded", within_seconds, within)
        return [
            StrandedPin(Pin(r["scope"], r["definition_id"], r["version"], r["plan_hash"]), int(r["instances"]),
                        int(r["deferred_commands"]), r["last_served"])
            for r in rows
        ]

    async def served(self, within_seconds: float) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._fetch("served", within_seconds)]

    # -- in-flight migration ----------------------------------------------------------------------

    async def migration_view(self, instance_id: str) -> dict[str, Any]:
        try:
            key = uuid.UUID(instance_id)
        except ValueError:
            raise InstanceNotFound(instance_id) from None
        row = await self._fetchrow("migration_view", key)
        if row is None:
            raise InstanceNotFound(instance_id)
        return {**dict(row), "id": str(row["id"])}

    async def pinned_contract(self, instance_id: str) -> dict[str, Any] | None:
        """The registry row (scope, id, version, plan hash, declared names, input schema) an instance is
        pinned to, or None when the instance or its row is not there."""
        try:
            key = uuid.UUID(instance_id)
        except ValueError:
            return None
        row = await self._fetchrow("pinned_contract", key)
        return None if row is None else dict(row)

    async def migration_candidates(
        self, definition_id: str, version: int, scope: str | None, limit: int,
        after: tuple[datetime, str] | None = None,
    ) -> list[tuple[str, datetime]]:
        at, key = (after[0], uuid.UUID(after[1])) if after is not None else (None, None)
        rows = await self._fetch("migration_candidates", definition_id, version, scope, limit, list(MAY_RUN), at, key)
        return [(str(r["id"]), r["created_at"]) for r in rows]

    async def reserve_command_seq(self) -> int:
        row = await self._fetchrow("reserve_command_seq")
        assert row is not None
        return int(row[0])

    async def migrate_instance(
        self, instance_id: str, *, order_seq: int, from_pin: Pin, state_version: int, to_pin: Pin,
        step_map: dict[str, str], positions: list[dict[str, Any]], state: Any, actor: str | None,
        served_within: float = SERVED_WITHIN_SECONDS,
    ) -> tuple[str, int | None]:
        row = await self._fetchrow(
            "migrate_instance", order_seq, uuid.UUID(instance_id), from_pin.version, from_pin.plan_hash, state_version,
            to_pin.version, to_pin.plan_hash, step_map, positions, state, actor, served_within,
        )
        assert row is not None
        return str(row["outcome"]), row["command_id"]

    async def check_admission(self, instance_id: str, to_pin: Pin) -> None:
        """Raise what the pin admission would raise for moving the instance to `to_pin`, writing nothing:
        a migration's dry run asks the database's own check rather than a copy of it."""
        with translate_errors(self.url):
            async with self.pool.acquire() as conn:
                tx = conn.transaction()
                await tx.start()
                try:
                    await conn.execute(self.q["pin_admits"], uuid.UUID(instance_id), to_pin.version, to_pin.plan_hash)
                finally:
                    await tx.rollback()

    # -- plumbing -------------------------------------------------------------------------------

    async def _fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        with translate_errors(self.url):
            return await self.pool.fetch(self.q[name], *args)

    async def _fetchrow(self, name: str, *args: Any) -> asyncpg.Record | None:
        with translate_errors(self.url):
            return await self.pool.fetchrow(self.q[name], *args)


class _OnConnection:
    """The registry reads of the activation check, on the activation's own connection (its transaction)."""

    def __init__(self, conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy, q: dict[str, str]) -> None:
        self.conn, self.q = conn, q

    async def select_version(self, scope: str, definition_id: str) -> tuple[str, int, str] | None:
        row = await self.conn.fetchrow(self.q["select_version"], scope, definition_id)
        return None if row is None else (str(row["target_scope"]), int(row["version"]), str(row["plan_hash"]))

    async def find(self, scope: str, definition_id: str, version: int) -> dict[str, Any]:
        row = await self.conn.fetchrow(self.q["definition_row"], scope, definition_id, version)
        return {} if row is None else dict(row)
