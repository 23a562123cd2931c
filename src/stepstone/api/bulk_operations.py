"""Bulk actions for the API and the UI: authorize, then call `stepstone.ops` (which matches, acts in
batches and reports one result per instance). Retry and cancel are here; migrate, which authorizes
the same way (`authorized`), is `stepstone.api.bulk_migration`.

A caller acts only where it holds the operator role. By ids: an instance it cannot see is reported
"no such instance", exactly like a missing one; one it sees without the role is reported refused;
the rest go to the operation. By filter: a caller with a ``*`` grant runs the filter as given; one
limited to some scopes runs it in each scope where it is operator (a scope it names outside those
matches nothing), so `matched` counts exactly the instances the call would act on. A caller that is
operator nowhere, or names a scope it sees without the role, is refused (Forbidden).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

from stepstone.api.auth import ALL_SCOPES, Forbidden, Principal
from stepstone.api.context import ApiContext, require
from stepstone.ops import InstanceFilter, Operations
from stepstone.ops.model import BulkItem, BulkReport

__all__ = ["Action", "Run", "authorized", "bulk"]

Action = Literal["retry", "cancel"]


async def _run(ops: Operations, action: Action, *, ids: Sequence[str] | None, where: InstanceFilter | None,
               reason: str, dry_run: bool, compensate: bool = False) -> BulkReport:
    if action == "retry":
        return await ops.retry(ids, where=where, dry_run=dry_run)
    return await ops.cancel(ids, where=where, reason=reason, dry_run=dry_run, compensate=compensate)


def _merge(into: BulkReport, more: BulkReport) -> None:
    into.matched += more.matched
    into.succeeded += more.succeeded
    into.failed += more.failed
    into.items.extend(more.items)


Run = Callable[[Sequence[str] | None, InstanceFilter | None], Awaitable[BulkReport]]
"""An operation on the instances `ids`, or on every one a filter matches (exactly one is given)."""


async def authorized(
    ctx: ApiContext, who: Principal, action: str, run: Run, *, ids: Sequence[str] | None,
    where: InstanceFilter | None, dry_run: bool,
) -> BulkReport:
    """`run` on what the caller may act on (see the module docstring); the rest reported per instance."""
    if not any(who.can("operator", s) for s in who.grants):
        raise Forbidden(f"{who.actor} needs the operator role for a bulk {action}", role="operator",
                        scope=where.scope if where and where.scope else ALL_SCOPES)
    if where is not None and where.scope is not None and who.sees(where.scope):
        require(who, "operator", where.scope)
    report = BulkReport(action, dry_run)
    if ids is not None:
        unique = list(dict.fromkeys(ids))
        scopes = await ctx.management.instance_scopes(unique)
        allowed = [i for i in unique if i in scopes and who.can("operator", scopes[i])]
        for i in unique:
            if i not in allowed:
                seen = i in scopes and who.sees(scopes[i])
                report.items.append(BulkItem(i, False, "forbidden" if seen else "not_found", None,
                                             f"needs the operator role in scope {scopes[i]!r}" if seen
                                             else "no such instance"))
        report.failed += len(report.items)
        if allowed:
            _merge(report, await run(allowed, None))
        return report
    where = where or InstanceFilter()
    if who.can("operator", ALL_SCOPES):
        return await run(None, where)
    mine = sorted(s for s in who.grants if s != ALL_SCOPES and who.can("operator", s))
    for scope in mine if where.scope is None else [s for s in mine if s == where.scope]:
        _merge(report, await run(None, replace(where, scope=scope)))
    return report


async def bulk(
    ctx: ApiContext, who: Principal, action: Action, *, ids: Sequence[str] | None = None,
    where: InstanceFilter | None = None, reason: str = "", dry_run: bool = False, compensate: bool = False,
) -> dict[str, Any]:
    """Retry or cancel the instances `ids`, or every one `where` matches; a dry run counts only."""
    ops = Operations.on(ctx.store, actor=who.actor)

    async def run(chosen: Sequence[str] | None, matching: InstanceFilter | None) -> BulkReport:
        return await _run(ops, action, ids=chosen, where=matching, reason=reason, dry_run=dry_run,
                          compensate=compensate)

    return (await authorized(ctx, who, action, run, ids=ids, where=where, dry_run=dry_run)).as_dict()
