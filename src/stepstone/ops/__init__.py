"""The operations the CLI, the HTTP API and the client share: queries, detail, history, the probe and
the stuck report, retention, repair, and the grants of least privilege.

    ops = Operations.on(store, actor="alice")          # any store `open_store` built
    page = await ops.find(InstanceFilter(status=("FAILED",), workflow="orders"))
    report = await ops.retry(where=InstanceFilter(status=("FAILED",)), dry_run=True)
    report = await ops.retention_run(dry_run=True)

Every result is a typed dataclass of `stepstone.ops.model`, with `as_dict()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from stepstone.core.attribution import Actor
from stepstone.core.bounds import MAX_BATCH, is_whole
from stepstone.core.limits import DEFAULT_LIMITS, PayloadRejected
from stepstone.core.timestamps import MAX_DURATION
from stepstone.errors import InvalidInput, refused
from stepstone.ops import queries, repair, retention
from stepstone.ops.model import (
    BulkReport,
    HistoryPage,
    InstanceDetail,
    InstancePage,
    ProbeReport,
    ReplayResult,
    RetentionReport,
    StuckReport,
)
from stepstone.store.factory import operations_store
from stepstone.store.operations_port import InstanceFilter, OperationsStore

__all__ = ["Actor", "InstanceFilter", "Operations", "check_texts"]


class Operations:
    """The operator's toolbox on one store. `actor` is recorded on everything it changes."""

    def __init__(self, store: OperationsStore, *, actor: str | Actor | None = None) -> None:
        self.store = store
        self.actor = actor.encode() if isinstance(actor, Actor) else actor

    @classmethod
    def on(cls, store: object, *, actor: str | Actor | None = None) -> Operations:
        """On any store `open_store` built (the client's included)."""
        return cls(operations_store(store), actor=actor)

    # -- reading ------------------------------------------------------------------------------

    async def find(self, where: InstanceFilter | None = None, *, after: tuple[datetime, str] | None = None,
                   limit: int = 50) -> InstancePage:
        _check_filter(where)
        return await queries.find(self.store, where or InstanceFilter(), after=after, limit=limit)

    async def count(self, where: InstanceFilter | None = None) -> dict[str, int]:
        _check_filter(where)
        return await queries.count(self.store, where or InstanceFilter())

    async def detail(self, instance_id: str, *, reveal: bool = False) -> InstanceDetail:
        return await queries.detail(self.store, instance_id, reveal=reveal)

    async def history(self, instance_id: str, *, after: int = 0, limit: int = 100,
                      failed_only: bool = False) -> HistoryPage:
        return await queries.history_page(self.store, instance_id, after=after, limit=limit, failed_only=failed_only)

    async def probe(self, instance_id: str | None = None, *, where: InstanceFilter | None = None) -> ProbeReport:
        check_texts(instance_id=instance_id)
        _check_filter(where)
        return await queries.probe(self.store, instance_id, where)

    async def stuck(self, older_than: timedelta = timedelta(minutes=15), *,
                    where: InstanceFilter | None = None) -> StuckReport:
        _check_filter(where)
        _check_duration("older_than", older_than)
        return await queries.stuck(self.store, older_than, where)

    # -- retention ----------------------------------------------------------------------------

    async def retention_policies(self) -> list[dict[str, Any]]:
        return await retention.policies(self.store)

    async def set_retention_policy(self, workflow: str, status_class: str, retain_for: timedelta | None,
                                   purge_after: timedelta | None = None) -> dict[str, Any]:
        check_texts(workflow=workflow, status_class=status_class)
        _check_duration("retain_for", retain_for)
        _check_duration("purge_after", purge_after)
        return await retention.set_policy(self.store, workflow, status_class, retain_for, purge_after)

    async def retention_run(self, *, dry_run: bool = False, batch_size: int = 500,
                            progress: retention.Progress | None = None, workflow: str | None = None,
                            scope: str | None = None) -> RetentionReport:
        check_texts(workflow=workflow, scope=scope)
        _check_batch(batch_size)
        return await retention.run(self.store, dry_run=dry_run, batch_size=batch_size, progress=progress,
                                   workflow=workflow, scope=scope)

    # -- repair -------------------------------------------------------------------------------

    async def retry(self, ids: Sequence[str] | None = None, *, where: InstanceFilter | None = None,
                    dry_run: bool = False, batch_size: int = 500,
                    progress: repair.Progress | None = None) -> BulkReport:
        _check_filter(where)
        _check_batch(batch_size)
        return await repair.retry(self.store, ids=ids, where=where, dry_run=dry_run, actor=self.actor,
                                  batch_size=batch_size, progress=progress)

    async def cancel(self, ids: Sequence[str] | None = None, *, where: InstanceFilter | None = None,
                     reason: str = "", dry_run: bool = False, batch_size: int = 500,
                     progress: repair.Progress | None = None, compensate: bool = False) -> BulkReport:
        check_texts(reason=reason, free=True)
        _check_filter(where)
        _check_batch(batch_size)
        return await repair.cancel(self.store, ids=ids, where=where, reason=reason, dry_run=dry_run,
                                   actor=self.actor, batch_size=batch_size, progress=progress, compensate=compensate)

    async def replay(self, instance_id: str, step: str) -> ReplayResult:
        check_texts(instance_id=instance_id, step=step)
        return await repair.replay(self.store, instance_id, step, actor=self.actor)

    # -- least privilege ----------------------------------------------------------------------

    async def grants(self, role: str, *, read_only: bool = False) -> list[str]:
        """The GRANT statements that make `role` a runtime role (or a read-only one)."""
        return await self.store.grants(role, read_only=read_only)

    async def apply_grants(self, role: str, *, read_only: bool = False) -> list[str]:
        statements = await self.grants(role, read_only=read_only)
        await self.store.apply_grants(statements)
        return statements

    async def role_can_alter_schema(self) -> tuple[str, bool]:
        """(this connection's role, whether it can change the schema: owner, CREATE or superuser)."""
        p = await self.store.role_privileges()
        return str(p.get("role")), bool(p.get("superuser") or p.get("owns_schema") or p.get("can_create"))


def check_texts(*, free: bool = False, **arguments: str | None) -> None:
    """Each text argument given (None: not given) as every operation checks it (`Limits.check_text`),
    refused as InvalidInput before it reaches a statement: PostgreSQL text cannot hold a NUL. The
    operations here and the API's routes share it."""
    try:
        DEFAULT_LIMITS.check_texts(arguments, free=free, empty=True)
    except PayloadRejected as exc:
        raise refused(exc) from None


def _check_duration(what: str, value: timedelta | None) -> None:
    """A window or an age from 0 to a thousand years, as the CLI takes them: now minus a longer one is
    no timestamp (`stuck` with one failed on it)."""
    if value is not None and not timedelta(0) <= value <= MAX_DURATION:
        raise InvalidInput(f"{what} must be from 0 to a thousand years, got {value}", what=what)


def _check_batch(batch_size: int) -> None:
    """As the CLI's --batch-size: 0 never advanced (a sweep looped on its first batch), a negative one
    reached the LIMIT, a huge one the driver."""
    if not is_whole(batch_size, 1, MAX_BATCH):
        raise InvalidInput(f"batch_size must be a whole number from 1 to {MAX_BATCH:,}, got {batch_size!r}",
                           what="batch_size")


def _check_filter(where: InstanceFilter | None) -> None:
    if where is not None:
        check_texts(workflow=where.workflow, scope=where.scope, business_key=where.business_key,
                    business_key_contains=where.business_key_contains, parent=where.parent)
        for status in where.status:
            check_texts(status=status)
