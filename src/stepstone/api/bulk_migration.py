"""Bulk migrate for the API and the UI: move a selection of instances, or every instance a filter
matches, to version `to_version` of its workflow, with a dry run that checks each one and a result
per instance (migrated, would migrate, refused and why, skipped).

Authorization is that of the other bulk actions (`stepstone.api.bulk_operations.authorized`): the
operator role where the instances live; another scope's instance is "no such instance". The target
of each instance is `to_version` of its own workflow in this server's registry (its --app); an
instance whose workflow has no such version there is refused, saying so. A filter without a status
matches the instances that may still run (every status but the ends: core.model.MAY_RUN), as the
CLI's batch migration does; one matching more than `MAX_MATCHED` instances is refused whole (narrow it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from stepstone.api.auth import Principal
from stepstone.api.bulk_operations import authorized
from stepstone.api.context import ApiContext
from stepstone.core.model import MAY_RUN
from stepstone.errors import InstanceNotFound, InvalidInput
from stepstone.ops import InstanceFilter, Operations
from stepstone.ops.migration import DEFAULT_PATIENCE
from stepstone.ops.model import BulkItem, BulkReport

__all__ = ["MAX_MATCHED", "MAY_RUN", "bulk_migrate"]

MAX_MATCHED = 10_000
"""A filter matching more instances than this is refused: each migration is checked one by one."""
_PAGE = 1000
_NOT_OK = ("refused", "not_found", "forbidden")


async def _matching(ops: Operations, where: InstanceFilter) -> list[tuple[str, str]]:
    """(id, workflow) of every instance `where` matches, newest first; InvalidInput past MAX_MATCHED."""
    found: list[tuple[str, str]] = []
    after = None
    while True:
        page = await ops.find(where, after=after, limit=_PAGE)
        found.extend((i.id, i.workflow) for i in page.items)
        if len(found) > MAX_MATCHED:
            raise InvalidInput(f"the filter matches more than {MAX_MATCHED:,} instances: narrow it (by workflow, "
                               "version, scope or status) and migrate in parts", what="filter")
        if page.next_after is None or len(page.items) < _PAGE:
            return found
        after = page.next_after


def summary(report: BulkReport, to_version: int) -> dict[str, Any]:
    """The report as JSON, its counts taken from the items: `matched` = every item, `succeeded` the
    migrated (or, in a dry run, would migrate), `failed` the refused, not found or forbidden ones,
    `skipped` those already on the target or ended; `counts` by outcome."""
    report.matched = len(report.items)
    report.failed = sum(i.outcome in _NOT_OK for i in report.items)
    report.succeeded = sum(i.outcome in ("migrated", "would migrate") for i in report.items)
    counts = Counter(i.outcome for i in report.items)
    return {**report.as_dict(), "to_version": to_version, "skipped": counts.get("skipped", 0),
            "counts": dict(sorted(counts.items()))}


async def bulk_migrate(
    ctx: ApiContext, who: Principal, to_version: int, *, ids: Sequence[str] | None = None,
    where: InstanceFilter | None = None, step_map: Mapping[str, str] | None = None, dry_run: bool = False,
    patience: float = DEFAULT_PATIENCE,
) -> dict[str, Any]:
    """Migrate the instances `ids`, or every one `where` matches, to `to_version`; see the module docstring."""
    if where is not None and not where.status:
        where = replace(where, status=MAY_RUN)
    ops = Operations.on(ctx.store, actor=who.actor)
    client = ctx.client(who.actor)

    async def run(chosen: Sequence[str] | None, matching: InstanceFilter | None) -> BulkReport:
        report = BulkReport("migrate", dry_run)
        if chosen is None:
            targets = await _matching(ops, matching or InstanceFilter(status=MAY_RUN))
        else:
            targets = []
            for instance_id in chosen:
                try:
                    targets.append((instance_id, (await client.get(instance_id)).definition_id))
                except InstanceNotFound:  # gone since its scope was read (purged)
                    report.items.append(BulkItem(instance_id, False, "not_found", None, "no such instance"))
        by_workflow: dict[str, list[str]] = {}
        for instance_id, workflow in targets:
            by_workflow.setdefault(workflow, []).append(instance_id)
        answers: dict[str, BulkItem] = {}
        for workflow, members in by_workflow.items():
            target = ctx.registry.find(workflow, to_version)
            if target is None:
                why = f"this server's workflows have no {workflow} v{to_version}"
                answers.update((i, BulkItem(i, False, "refused", None, why)) for i in members)
                continue
            migrated = await client.migrate(members, to=target, step_map=dict(step_map or {}), dry_run=dry_run,
                                            patience=patience)
            answers.update((o.instance_id, BulkItem(o.instance_id, o.outcome != "refused", o.outcome, None,
                                                    o.reason or None)) for o in migrated.outcomes)
        report.items.extend(answers[i] for i, _ in targets)  # in the order asked (a filter's: newest first)
        return report

    report = await authorized(ctx, who, "migrate", run, ids=ids, where=where, dry_run=dry_run)
    return summary(report, to_version)
