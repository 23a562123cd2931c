"""The instance operations behind the API's and the UI's routes: authorize, then call the client.

Every function takes the caller's principal; a state change is made by a client acting as the
caller's actor, so the history records who did it. Reads of another scope's instance are
InstanceNotFound; writes without the role are Forbidden.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from stepstone import cursors
from stepstone.api.auth import Principal
from stepstone.api.context import ApiContext, require, visible_instance
from stepstone.api.pagination import decode_cursor, decode_id_cursor, page
from stepstone.core.attribution import Actor
from stepstone.core.limits import MAX_INT4
from stepstone.core.pin import DEFAULT_SCOPE, check_scope
from stepstone.errors import DefinitionNotFound
from stepstone.ops import check_texts
from stepstone.ops import definitions as definition_ops
from stepstone.ops.history import compensations_shown

__all__ = [
    "activate",
    "cancel",
    "commands",
    "compensations",
    "counts",
    "dead_letters",
    "definition_plan",
    "definitions",
    "history",
    "instance",
    "instances",
    "outbox_events",
    "retry",
    "signal",
    "start",
    "stranded",
]


async def instances(
    ctx: ApiContext, who: Principal, *, statuses: Sequence[str] = (), workflow: str | None,
    business_key: str | None, scope: str | None, cursor: str | None, limit: int, include_archived: bool = False,
) -> dict[str, Any]:
    """A page of the instances of any of `statuses` (none: every status), newest first."""
    check_texts(workflow=workflow, business_key=business_key, scope=scope)
    for status in statuses:
        check_texts(status=status)
    scopes = _listed_scopes(who, scope)
    after = decode_cursor(cursor, cursors.INSTANT, cursors.UUID) if cursor else None
    rows = [] if scopes == [] else await ctx.management.instances_page(
        scopes, statuses=statuses, definition=workflow, business_key=business_key, after=after, limit=limit + 1,
        include_archived=include_archived)
    return page(rows, limit, lambda r: (r["created_at"].isoformat(), r["id"]))


def _listed_scopes(who: Principal, scope: str | None) -> list[str] | None:
    """The scopes a list (and its counts) reads: the caller's, or the one asked for if it sees it
    (None: every scope; []: none)."""
    if scope is not None:
        return [scope] if who.sees(scope) else []
    scopes = who.visible_scopes()
    return None if scopes is None else list(scopes)


COUNT_CAP = 10_000
"""Counts stop here: a status with more instances shows as "more than 10,000"."""


async def counts(ctx: ApiContext, who: Principal, workflow: str | None, include_archived: bool = False, *,
                 scope: str | None = None, business_key: str | None = None) -> dict[str, Any]:
    """``{"counts": {status: n}, "more_than": [statuses with more than COUNT_CAP], "cap": COUNT_CAP}``:
    each status counted up to the cap, so the cost does not grow with the table. The filters are the
    list's (`instances`), so the counts count what it lists."""
    check_texts(workflow=workflow, scope=scope, business_key=business_key)
    scopes = _listed_scopes(who, scope)
    found = {} if scopes == [] else await ctx.management.instance_counts(
        scopes, workflow, COUNT_CAP, include_archived, business_key=business_key)
    more = sorted(s for s, n in found.items() if n > COUNT_CAP)
    return {"counts": {s: min(n, COUNT_CAP) for s, n in found.items()}, "more_than": more, "cap": COUNT_CAP}


async def instance(ctx: ApiContext, who: Principal, instance_id: str) -> dict[str, Any]:
    scope = await visible_instance(ctx, who, instance_id)
    info = await ctx.client(who.actor).get(instance_id)
    redaction = (await ctx.management.redactions([instance_id])).get(instance_id)
    # A shallow copy: asdict's deep copy of a large state took longer than reading it (docs/api.md, "Measured").
    # The state as `stepstone show` shows it: sensitive values redacted (docs/operations.md, Redaction), and so
    # is a wait's correlation key read from one of them.
    if redaction is None:
        return {**vars(info), "scope": scope}
    waiting_for, positions = redaction.shown_waits(info.state, info.waiting_for, info.positions)
    return {**vars(info), "scope": scope, "state": redaction.shown_state(info.state), "waiting_for": waiting_for,
            "positions": positions}


async def compensations(ctx: ApiContext, who: Principal, instance_id: str) -> list[dict[str, Any]]:
    """The steps the instance completed that declare a compensation, in order, with what became of each."""
    await visible_instance(ctx, who, instance_id)
    return compensations_shown(await ctx.client(who.actor).compensations(instance_id))


async def history(
    ctx: ApiContext, who: Principal, instance_id: str, *, cursor: str | None, limit: int, failed_only: bool
) -> dict[str, Any]:
    await visible_instance(ctx, who, instance_id)
    after = decode_id_cursor(cursor, cursors.INT4_KEY)  # history.seq is an integer (int4)
    rows = await ctx.management.history_page(instance_id, after=after, limit=limit + 1, failed_only=failed_only)
    return page([_entry(r) for r in rows], limit, lambda r: (r["seq"],))


def _entry(row: dict[str, Any]) -> dict[str, Any]:
    """A history row as `stepstone history -o json` shows it: the actor as an object (the stored text is a
    bare id or JSON) and the root position as ''."""
    actor = Actor.parse(row["actor"])
    return {**row, "actor": None if actor is None else actor.as_dict(), "position": row["position"] or ""}


async def commands(
    ctx: ApiContext, who: Principal, instance_id: str, *, states: list[str] | None, cursor: str | None, limit: int
) -> dict[str, Any]:
    async def rows(after: int) -> list[dict[str, Any]]:
        return await ctx.management.commands_page(instance_id, after=after, limit=limit + 1, states=states)

    return await _by_id(ctx, who, instance_id, rows, cursor, limit)


async def outbox_events(
    ctx: ApiContext, who: Principal, instance_id: str, *, cursor: str | None, limit: int
) -> dict[str, Any]:
    async def rows(after: int) -> list[dict[str, Any]]:
        return await ctx.management.instance_outbox(instance_id, after=after, limit=limit + 1)

    return await _by_id(ctx, who, instance_id, rows, cursor, limit)


async def _by_id(
    ctx: ApiContext, who: Principal, instance_id: str, rows: Callable[[int], Awaitable[list[dict[str, Any]]]],
    cursor: str | None, limit: int,
) -> dict[str, Any]:
    """A page of an instance's rows keyed by id, after checking the caller sees the instance."""
    await visible_instance(ctx, who, instance_id)
    return page(await rows(decode_id_cursor(cursor)), limit, lambda r: (r["id"],))


async def dead_letters(ctx: ApiContext, who: Principal, *, cursor: str | None, limit: int,
                       workflow: str | None = None, scope: str | None = None) -> dict[str, Any]:
    check_texts(workflow=workflow, scope=scope)
    scopes = _listed_scopes(who, scope)
    before = decode_id_cursor(cursor) if cursor else None
    rows = [] if scopes == [] else await ctx.management.dead_commands_page(scopes, before=before, limit=limit + 1,
                                                                           definition=workflow)
    return page(rows, limit, lambda r: (r["id"],))


async def definitions(ctx: ApiContext, who: Principal, *, cursor: str | None, limit: int) -> dict[str, Any]:
    scopes = who.visible_scopes()
    after = decode_cursor(cursor, cursors.TEXT, cursors.TEXT, cursors.INT4_KEY) if cursor else None
    rows = [] if scopes == [] else await ctx.management.definitions_page(scopes, after=after, limit=limit + 1)
    return page(rows, limit, lambda r: (r["scope"], r["definition_id"], r["version"]))


async def definition_plan(
    ctx: ApiContext, who: Principal, scope: str, definition_id: str, version: int
) -> dict[str, Any]:
    check_texts(scope=scope, workflow=definition_id)
    # No version column holds one past int4 (the UI's page takes it from its path unchecked): not found,
    # not the driver's overflow.
    held = who.sees(scope) and 1 <= version <= MAX_INT4
    found = await ctx.management.definition_plan(scope, definition_id, version) if held else None
    if found is None:
        raise DefinitionNotFound(definition_id, version)
    return found


async def activate(
    ctx: ApiContext, who: Principal, scope: str, definition_id: str, version: int, *, from_default: bool,
) -> dict[str, Any]:
    """Make `version` (of `scope`, or of the default scope) the scope's current version, as `stepstone
    definitions activate` does: the operator role in `scope`; a version of a scope the caller does not see
    (the default scope's, for a tenant's token) is not found. The schedules whose input the version refuses
    are those of the scopes the caller sees."""
    check_texts(scope=scope, workflow=definition_id)
    target = DEFAULT_SCOPE if from_default else scope
    if not (who.sees(scope) and who.sees(target)) or not 1 <= version <= MAX_INT4:
        raise DefinitionNotFound(definition_id, version)
    require(who, "operator", scope)
    done = await definition_ops.activate(ctx.store, scope, definition_id, version, target_scope=target,
                                         actor=who.actor)
    answer = done.as_dict()
    answer["schedules_refused"] = [r for r in answer["schedules_refused"] if who.sees(r["scope"])]
    return answer


async def stranded(ctx: ApiContext, who: Principal, within_seconds: float) -> list[dict[str, Any]]:
    """Pins whose instances of the visible scopes may still run but that no worker served lately: the
    counts are of those instances alone (a pin's `scope` is its registration's, which an instance of
    another scope may be admitted on)."""
    # The registry's port itself: `stepstone.ops.definitions.stranded_report` wraps the same call but
    # brings the runtime along, which the API must not import.
    scopes = who.visible_scopes()
    found = [] if scopes == [] else await ctx.store.definitions.stranded(
        within_seconds, scopes=None if scopes is None else list(scopes))
    return [{"scope": s.pin.scope, "definition_id": s.pin.definition_id, "version": s.pin.version,
             "plan_hash": s.pin.plan_hash, "instances": s.instances, "deferred_commands": s.deferred_commands,
             "last_served": s.last_served} for s in found]


async def start(
    ctx: ApiContext, who: Principal, workflow: str, data: Any, *, scope: str | None,
    idempotency_key: str | None, business_key: str | None, deadline: float | None = None,
) -> dict[str, Any]:
    check_texts(scope=scope)
    target = check_scope(scope if scope is not None else who.home_scope(ctx.default_scope))
    if not who.sees(target):
        raise DefinitionNotFound(workflow)
    require(who, "operator", target)
    instance_id = await ctx.client(who.actor).start(
        workflow, data, idempotency_key=idempotency_key, business_key=business_key, scope=target, deadline=deadline)
    return {"id": instance_id, "scope": target}


async def signal(
    ctx: ApiContext, who: Principal, instance_id: str, name: str, payload: Any, *,
    dedup_key: str | None, position: str,
) -> dict[str, Any]:
    require(who, "operator", await visible_instance(ctx, who, instance_id))
    command_id = await ctx.client(who.actor).signal(instance_id, name, payload, dedup_key=dedup_key,
                                                    position=position)
    return {"instance_id": instance_id, "signal": name, "command_id": command_id}


async def cancel(
    ctx: ApiContext, who: Principal, instance_id: str, reason: str, *, compensate: bool = False,
) -> dict[str, Any]:
    require(who, "operator", await visible_instance(ctx, who, instance_id))
    done = await ctx.client(who.actor).cancellation(instance_id, reason, compensate=compensate)
    return {"instance_id": instance_id, "status": done.status, "outcome": done.outcome}


async def retry(ctx: ApiContext, who: Principal, instance_id: str) -> dict[str, Any]:
    require(who, "operator", await visible_instance(ctx, who, instance_id))
    client = ctx.client(who.actor)
    await client.retry(instance_id)
    return {"instance_id": instance_id, "status": (await client.get(instance_id)).status}
